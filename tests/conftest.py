import pathlib
import sys

# Lets the test modules import the shared helpers in tests/problems.py.
sys.path.insert(0, str(pathlib.Path(__file__).parent))
