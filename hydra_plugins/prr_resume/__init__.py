"""prr's Hydra plugins (found by Hydra's plugin scan of the `hydra_plugins` namespace; the repo
root is on sys.path when you run `python run.py`)."""
