import os
import sys

# Tests import the top-level scripts (attention.py, model.py, ...) from the repo root.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import pytest  # noqa: E402


def pytest_addoption(parser):
    parser.addoption('--course-full', action='store_true',
                     help="also run docs/COURSE.md's lessons 1-5 as written (needs data; about 5 minutes on an idle 2-core CPU)")


def pytest_collection_modifyitems(config, items):
    if not config.getoption('--course-full'):
        skip = pytest.mark.skip(reason='the full course runs with --course-full')
        for item in items:
            if 'course_full' in item.keywords:
                item.add_marker(skip)
