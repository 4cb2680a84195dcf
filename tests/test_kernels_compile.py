"""The compile check (issue 34): every launch kernels.py's launcher picks, compiled ahead of time on the CPU for
sm_80 (A100) and sm_90 (H100) with the installed triton and the ptxas and cuobjdump in its wheel
(triton/backends/nvidia/bin). A launch fails on a compile error, a register spill (ptxas -v), dynamic shared
memory over the architecture's per-block limit, or, with bf16 operands, no tensor-core instruction (HMMA, HGMMA)
in its SASS.

The launches are those of B*H = 12 heads at T = 32K (the benchmark's size; T only sets the grid), with the
specialisation the launcher gets there: 16-byte aligned pointers, T, F, D multiples of 16. Run as a script it
prints the resource table of docs/RESULTS.md section 16:

    python tests/test_kernels_compile.py           # Hedgehog's default: F=128, D=64, bf16 (the quick test)
    python tests/test_kernels_compile.py --full    # F in {D, 2D}, D in {32, 64, 128}; bf16, fp16, fp32 (slow test)
    python tests/test_kernels_compile.py --control # a launch too large for an A100: the check must flag it

The tests run it in a subprocess: compiling needs triton imported without TRITON_INTERPRET, which
tests/test_kernels.py sets for its whole process on a CPU-only machine.
"""
import importlib.util
import os
import re
import subprocess
import sys
import tempfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Dynamic shared memory one block may opt in to: 163 KiB on sm_80, 227 KiB on sm_90 (CUDA C++ Programming Guide,
# "Compute Capabilities", table "Technical Specifications per Compute Capability": maximum amount of shared memory
# per thread block; the Ampere and Hopper tuning guides, docs.nvidia.com/cuda/{ampere,hopper}-tuning-guide, say the
# same: the SM's 164 / 228 KB less the 1 KB CUDA reserves per block).
SHARED_LIMIT = {80: 163 * 1024, 90: 227 * 1024}
QUICK = [(128, 64, 'bf16')]
FULL = [(F, D, dt) for D in (32, 64, 128) for F in (D, 2 * D) for dt in ('bf16', 'fp16', 'fp32', 'fp32-tf32')]
OPTIONAL = dict.fromkeys(('fwd state', 'bwd dstate'), ('S_IN', 'Z_IN', 'S_OUT', 'Z_OUT'))   # pointers that may be
# None
OPERANDS = {'Q', 'K', 'V', 'X', 'Y', 'DY', 'DQ', 'DK', 'DV'}   # pointers in the operands' dtype (the states
# STATES, DSTATES: if bf16); the others fp32


def _bin_dir():
    """triton's bundled ptxas and cuobjdump, without importing triton; None where absent (macOS, Windows)."""
    spec = importlib.util.find_spec('triton')
    if spec is None or not spec.submodule_search_locations:
        return None
    d = os.path.join(list(spec.submodule_search_locations)[0], 'backends', 'nvidia', 'bin')
    ok = all(os.access(os.path.join(d, t), os.X_OK) for t in ('ptxas', 'cuobjdump'))
    return d if ok else None


def compile_launch(kernel, meta, arch, dtype, types=None):
    """Compile one launch for sm_<arch>: kernel, its constexprs and num_warps (meta), the operands' dtype ('bf16',
    'fp16', 'fp32'), the types of arguments the defaults below do not give (types). Returns registers, stack frame
    and shared memory (bytes), spill stores, tensor-core instructions."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    meta, types = dict(meta), types or {}
    warps = meta.pop('num_warps')
    sig, attrs = {}, {}
    for i, (name, p) in enumerate(zip(kernel.arg_names, kernel.params)):
        if p.is_constexpr or name in meta:   # a constexpr, or an optional pointer passed as None
            sig[name] = 'constexpr'
            continue
        sig[name] = types.get(name) or ('i32' if name in ('T', 'F', 'D') else 'fp32' if name == 'eps' else
                                        '*' + dtype if name in OPERANDS or (name in ('STATES', 'DSTATES') and
                                                                            dtype == 'bf16') else '*fp32')
        if name != 'eps':   # 16-byte aligned pointers; T, F, D multiples of 16
            attrs[(i,)] = [['tt.divisibility', 16]]
    compiled = triton.compile(ASTSource(kernel, sig, meta, attrs), target=GPUTarget('cuda', arch, 32),
                              options={'num_warps': warps})
    with tempfile.TemporaryDirectory() as tmp:
        path, ptx = os.path.join(tmp, 'k.cubin'), os.path.join(tmp, 'k.ptx')
        with open(path, 'wb') as f:
            f.write(compiled.asm['cubin'])
        with open(ptx, 'w') as f:
            f.write(compiled.asm['ptx'])
        tool = os.path.join(_bin_dir(), 'cuobjdump')
        res = subprocess.run([tool, '-res-usage', path], capture_output=True, text=True, check=True).stdout
        sass = subprocess.run([tool, '-sass', path], capture_output=True, text=True, check=True).stdout
        info = subprocess.run([os.path.join(_bin_dir(), 'ptxas'), f'-arch=sm_{arch}' + 'a' * (arch == 90), '-v', ptx,
                               '-o', os.path.join(tmp, 'k.o')], capture_output=True, text=True, check=True).stderr
    return dict(regs=int(re.search(r'REG:(\d+)', res).group(1)), stack=int(re.search(r'STACK:(\d+)', res).group(1)),
                shared=compiled.metadata.shared, stl=int(re.search(r'(\d+) bytes spill stores', info).group(1)),
                mma=len(re.findall(r'\bH(?:G)?MMA\b', sass)))


def problems(r, arch, dtype):
    """What is wrong with a launch's resources r on sm_<arch>: register spills (ptxas -v: spill stores; a stack frame
    alone is libdevice's sin and cos, whose slow path for large angles keeps 32 bytes), shared memory over the
    limit, no tensor-core instruction with bf16 operands."""
    return [f'{r["stl"]} B of spill stores (spills)'] * (r['stl'] > 0) + \
        [f'shared {r["shared"]} B > {SHARED_LIMIT[arch]}'] * (r['shared'] > SHARED_LIMIT[arch]) + \
        ['no tensor-core instruction'] * (dtype == 'bf16' and r['mma'] == 0)


def control():
    """The check must be able to fail: 'fwd out' with blocks of 128 rows, features and values at 4 warps, bf16, on
    sm_80 spills and asks more shared memory than an A100 has."""
    import kernels as K
    meta = dict(BLOCK_T=128, BLOCK_F=128, BLOCK_D=128, num_warps=4, BF16=True, PRECISION='tf32')
    bad = problems(compile_launch(K._fwd_kernel, meta, 80, 'bf16'), 80, 'bf16')
    print('control (fwd out, blocks 128, 4 warps, bf16, sm_80):', ', '.join(bad))
    return len(bad) == 2


def decode_launches(F, D, dt):
    """The fused decode step's launches at SmolLM2's grouping (3 query heads a KV head) for a window of 64 and 4
    sinks, with nope, with and without a decay (its shifts and m in float64), where kernels.decode_warps serves the
    sizes: (name, kernel, meta, argument types)."""
    import triton
    import kernels as K
    if not K.decode_warps(F, D, 68):   # (larger tiles keep the PyTorch step)
        return
    ints = {n: 'i32' for n in ('H', 'D', 'FW', 'L', 'W', 'N')}
    ring = {n: '*i64' for n in ('RP', 'RP2', 'POS')}
    for decay in (False, True):
        meta = dict(G=3, BD=D, BU=F // 2, BL=triton.next_power_of_2(68), SKIP=False, LOG=False, NOPE=True, DECAY=decay,
                    WINDOW=True, MIX=False, num_warps=K.decode_warps(F, D))
        yield 'decode step' + ' +decay' * decay, K._decode_kernel, meta, {**ints, **ring, **dict.fromkeys(
            ('M', 'M2'), '*fp64' if decay else '*fp32')}


def check(cases):
    """Compile every launch of every case on sm_80 and sm_90; print one line each; return the failures."""
    import torch
    import kernels as K
    failures = []
    print(f'triton {K.triton.__version__}; B*H=12, T=32768; limits: shared {SHARED_LIMIT} B, stack 0')
    print(f'{"arch":<6}{"dtype":<10}{"F":>4}{"D":>4}  {"launch":<17}{"grid":<15}{"blocks":<12}{"warps":>5}'
          f'{"regs":>6}{"stack":>6}{"shared":>8}{"spill":>6}{"MMA":>5}')
    for F, D, dt in cases:
        dtype = {'bf16': torch.bfloat16, 'fp16': torch.float16}.get(dt, torch.float32)
        for arch in (80, 90):
            for name, (kernel, grid, meta) in K._launches(12, 32768, F, D, K.DEFAULT_CHUNK,
                                                          K._cfg(dtype, dt == 'fp32-tf32')).items():
                # the sequential passes with their optional states (initial, final) as None, then given
                flags = [dict.fromkeys(OPTIONAL[name]), {}] if name in OPTIONAL else [{}]
                for fl in flags:
                    launch = name + (' +init' if name in OPTIONAL and not fl else '')
                    label = f'sm_{arch:<3}{dt:<10}{F:>4}{D:>4}  {launch:<17}'
                    try:
                        r = compile_launch(kernel, {**meta, **fl}, arch, dt[:4])
                    except Exception as e:  # a compile error
                        failures.append(f'{label} compile error: {str(e).splitlines()[0][:200]}')
                        print(failures[-1], flush=True)
                        continue
                    blocks = f'{meta["BLOCK_T"]},{meta["BLOCK_F"]},{meta["BLOCK_D"]}'
                    print(f'{label}{str(grid):<15}{blocks:<12}{meta["num_warps"]:>5}{r["regs"]:>6}{r["stack"]:>6}'
                          f'{r["shared"]:>8}{r["stl"]:>5}{r["mma"]:>5}', flush=True)
                    bad = problems(r, arch, dt)
                    failures += [f'{label} {", ".join(bad)}'] * bool(bad)
            for name, kernel, meta, types in decode_launches(F, D, dt):
                label = f'sm_{arch:<3}{dt:<10}{F:>4}{D:>4}  {name:<17}'
                try:
                    r = compile_launch(kernel, meta, arch, dt[:4], types)
                except Exception as e:  # a compile error
                    failures.append(f'{label} compile error: {str(e).splitlines()[0][:200]}')
                    print(failures[-1], flush=True)
                    continue
                print(f'{label}{"(B, H_kv)":<15}{f"-,{F},{D}":<12}{meta["num_warps"]:>5}{r["regs"]:>6}{r["stack"]:>6}'
                      f'{r["shared"]:>8}{r["stl"]:>5}{r["mma"]:>5}', flush=True)
                bad = [x for x in problems(r, arch, dt) if 'tensor-core' not in x]   # (no dot: no tensor cores)
                failures += [f'{label} {", ".join(bad)}'] * bool(bad)
    return failures


def _run_script(*args):
    env = {k: v for k, v in os.environ.items() if k != 'TRITON_INTERPRET'}
    r = subprocess.run([sys.executable, os.path.abspath(__file__), *args], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=3600)
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-3000:]
    return r.stdout


needs_ptxas = pytest.mark.skipif(_bin_dir() is None, reason="triton or its bundled ptxas/cuobjdump is absent (e.g. "
                                                            "macOS, Windows): nothing to compile with")


@needs_ptxas
def test_compile_check_flags_an_oversized_launch():
    out = _run_script('--control')
    assert 'spills' in out and 'shared' in out, out


@needs_ptxas
def test_compile_default_launches():
    """Hedgehog's default (F=128, D=64, bf16): every forward and backward launch and the fused decode step on sm_80
    and sm_90."""
    out = _run_script()
    assert len(re.findall(r'^sm_(80|90) ', out, re.M)) == 2 * 9, out   # 5 launches, the 2 state ones twice; decode x2
    assert len(re.findall(r'^sm_(80|90) .* decode step', out, re.M)) == 4, out


@needs_ptxas
@pytest.mark.slow
def test_compile_every_launch():
    """Every (F, D, dtype) the maps produce, on sm_80 and sm_90."""
    import kernels as K
    out = _run_script('--full')
    decode = sum(2 for F, D, _ in FULL if K.decode_warps(F, D, 68))
    assert len(re.findall(r'^sm_(80|90) ', out, re.M)) == 2 * (7 * len(FULL) + decode), out


if __name__ == '__main__':
    sys.path.insert(0, ROOT)
    if os.environ.get('TRITON_INTERPRET', '0') == '1':
        raise SystemExit('unset TRITON_INTERPRET: compiling needs the real triton')
    if '--control' in sys.argv[1:]:
        sys.exit(0 if control() else 1)
    fails = check(FULL if '--full' in sys.argv[1:] else QUICK)
    print(f'{len(fails)} launch(es) failed' + ''.join('\n  ' + f for f in fails) if fails else 'all launches clean')
    sys.exit(1 if fails else 0)
