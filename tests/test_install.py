"""The install and the repository as a user gets them, without the network: the pins of requirements*.txt against
what torch itself requires on each platform (a resolver, offline, cannot see the registry: the table below is what
`uv pip compile --only-binary :all:` resolved, README "Install"), the data the documents use in data/, and no path
that leaves the repository."""
import os
import re
import subprocess
import sys

import pytest
from packaging.requirements import Requirement

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# torch's own requirement on triton, per platform, as `uv pip compile` resolved torch==2.13.0 from PyPI (2026-11-25):
# the CUDA build on Linux x86_64 depends on triton==3.7.1; the macOS arm64 (14+) and Windows x86_64 wheels on none.
TORCH_TRITON = {'2.13.0': {'linux': '3.7.1', 'darwin': None, 'win32': None}}
PLATFORMS = {'linux': dict(sys_platform='linux', platform_system='Linux', platform_machine='x86_64'),
             'darwin': dict(sys_platform='darwin', platform_system='Darwin', platform_machine='arm64'),
             'win32': dict(sys_platform='win32', platform_system='Windows', platform_machine='AMD64')}


def pins(files, platform):
    """{name: version} of the requirement files' lines whose markers hold on `platform`; each pinned with ==."""
    env, out = dict(PLATFORMS[platform], python_version='3.11', python_full_version='3.11.7'), {}
    for fn in files:
        for line in open(os.path.join(ROOT, fn), encoding='utf-8'):
            line = line.split('#')[0].strip()
            if not line:
                continue
            req = Requirement(line)
            assert len(req.specifier) == 1 and next(iter(req.specifier)).operator == '==', (fn, line, 'pin it')
            if req.marker is None or req.marker.evaluate(env):
                assert req.name not in out, (fn, req.name, 'pinned twice')
                out[req.name] = next(iter(req.specifier)).version
    return out


@pytest.mark.parametrize('platform', sorted(PLATFORMS))
@pytest.mark.parametrize('files', [('requirements.txt',), ('requirements.txt', 'requirements-dev.txt')])
def test_triton_is_pinned_only_as_torch_pins_it(platform, files):
    """requirements.txt never pins triton (torch brings it); the dev file pins torch's own version, on Linux only
    (macOS and Windows have no triton wheel)."""
    p = pins(files, platform)
    assert p['torch'] in TORCH_TRITON, f"torch {p['torch']} is not in the table: resolve it and add its row"
    assert 'triton' not in pins(('requirements.txt',), platform)
    if 'triton' in p:
        assert p['triton'] == TORCH_TRITON[p['torch']][platform], (platform, p['triton'])


def test_the_installed_torch_and_triton_are_the_pinned_ones():
    """What this machine runs is what the requirements say (the compile check reads triton's own ptxas)."""
    import torch
    if sys.platform not in PLATFORMS:
        pytest.skip(f'{sys.platform} is none of the platforms the requirements are resolved for')
    here = pins(('requirements.txt', 'requirements-dev.txt'), sys.platform)
    assert torch.__version__.split('+')[0] == here['torch']
    if 'triton' in here:
        triton = pytest.importorskip('triton')
        assert triton.__version__ == here['triton']


def tracked_files():
    r = subprocess.run(['git', 'ls-files'], cwd=ROOT, capture_output=True, text=True)
    if r.returncode:
        pytest.skip('not a git checkout')
    return [f for f in r.stdout.splitlines() if os.path.isfile(os.path.join(ROOT, f))]


def test_no_tracked_file_names_a_path_outside_the_repository():
    """docs/RESULTS.md records its commands as they were run (its first lines say where the data is now)."""
    bad = []
    for fn in tracked_files():
        if fn == 'docs/RESULTS.md' or fn.startswith('data/') or fn.endswith('.png'):
            continue
        text = open(os.path.join(ROOT, fn), encoding='utf-8', errors='replace').read()
        for m in re.finditer(r'(?:\.\./)+[\w.\-/]*', text):
            if not os.path.realpath(os.path.join(ROOT, os.path.dirname(fn), m.group())).startswith(ROOT + os.sep):
                bad.append(f'{fn}: {m.group()}')
    assert not bad, bad


def test_data_is_in_the_repository_as_its_readme_says():
    """Every file data/README.md lists, with its size in bytes; the documents' data paths exist."""
    rows = [r.split('|') for r in open(os.path.join(ROOT, 'data', 'README.md'), encoding='utf-8')
            if r.startswith('| `')]
    listed = {p: int(s.replace(',', '')) for r in rows
              for p, s in zip(re.findall(r'`([^`]+)`', r[1]), re.findall(r'([\d,]+) B\b', r[3]))}
    assert len(listed) == 5, listed
    for path, size in listed.items():
        assert os.path.getsize(os.path.join(ROOT, 'data', path)) == size, path
    for doc in ('README.md', 'docs/COURSE.md', 'convert.py', 'train.py', 'eval.py'):
        for path in re.findall(r'\bdata/[\w\-/]+(?:\.\w+)?', open(os.path.join(ROOT, doc), encoding='utf-8').read()):
            assert os.path.exists(os.path.join(ROOT, path)), (doc, path)
