import os
import sys

# Tests import the top-level scripts (attention.py, model.py, ...) from the repo root.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
