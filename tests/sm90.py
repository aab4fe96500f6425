"""Compile a Triton kernel for sm90 (Hopper) on a machine without a GPU: Triton ships ptxas and cuobjdump. For
tests that pin what the interpreter cannot see (instruction mix, tensor-core form, spills); run them through
conftest.run_in_triton_interpreter(code, interpret=False), which puts Triton and this directory on the path."""

import pathlib
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource


def compile_sm90(fn, signature: dict, constexprs: dict, aligned, num_warps: int = 4, num_stages: int = 3,
                 **options):
    """The compiled kernel; `aligned`: the arguments a launch specializes as multiples of 16 (16-byte aligned
    pointers, sizes and strides divisible by 16), which decides vector widths and async copies; `options`: more
    compile options, as a launch passes them (e.g. enable_fp_fusion=False)."""
    names = list(signature) + list(constexprs)
    sig = {**signature, **{k: "constexpr" for k in constexprs}}
    attrs = {(names.index(a),): [["tt.divisibility", 16]] for a in aligned}
    src = ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps,
                                                                          "num_stages": num_stages, **options})


def cuobjdump(kernel, *flags: str) -> str:
    """cuobjdump's output for the kernel's cubin: "-sass" for the SASS, "-res-usage" for registers and stack."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        tool = pathlib.Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
        return subprocess.run([str(tool), *flags, f.name], capture_output=True, text=True, check=True).stdout


def count(sass: str, op: str) -> int:
    """How many instructions of opcode `op` (any modifiers) the SASS holds."""
    return len(re.findall(r"\b" + op + r"\b", sass))


def stack_bytes(kernel) -> int:
    """Bytes of stack a thread uses (spilled registers) per cuobjdump -res-usage."""
    return int(re.search(r"STACK:(\d+)", cuobjdump(kernel, "-res-usage")).group(1))


def main_loop(sass: str) -> str:
    """The SASS lines of the longest loop (the span of the longest backward branch): a kernel's K walk."""
    lines = [line for line in sass.splitlines() if re.match(r"\s+/\*[0-9a-f]+\*/", line)]
    addr = [int(re.match(r"\s+/\*([0-9a-f]+)\*/", line).group(1), 16) for line in lines]
    spans = [(a - int(m.group(1), 16), int(m.group(1), 16), a) for line, a in zip(lines, addr)
             for m in [re.search(r"BRA (0x[0-9a-f]+)", line)] if m and int(m.group(1), 16) < a]
    _, start, end = max(spans)
    return "\n".join(line for line, a in zip(lines, addr) if start <= a <= end)
