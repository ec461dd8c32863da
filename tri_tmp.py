import sys, tempfile, time
from pathlib import Path
from tests.test_one_engine import check_same_algorithm
t = time.time()
check_same_algorithm(Path(tempfile.mkdtemp()), ("indexer", *sys.argv[1:]), [])
print("OK", sys.argv[1:], time.time() - t)
