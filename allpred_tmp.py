import sys, tempfile, traceback
from pathlib import Path
from tests.test_one_engine import PREDICTORS, check_same_algorithm
extra = sys.argv[1:]
for p in PREDICTORS:
    try:
        check_same_algorithm(Path(tempfile.mkdtemp()), ("indexer", p, *extra), [])
        print("OK", p, flush=True)
    except Exception as e:
        print("FAIL", p, repr(e)[:600], flush=True)
