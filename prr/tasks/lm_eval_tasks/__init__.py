"""Local lm-eval YAML tasks (prr_niah, prr_vt, prr_qa) and their data functions (prr_data.py)."""
