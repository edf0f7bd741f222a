"""Compares the SASS of every kernel between two builds of the extension.

    python tools/compare_sass.py BEFORE AFTER

BEFORE and AFTER are object files, shared libraries or build directories
(searched for *.o). Each kernel's SASS (``cuobjdump -sass``, instruction words
included) is compared with its namesake's, names matched after demangling and
after the renames below (old kernel and type names to new), and the
instructions' symbol references are compared by their renamed names too.
Prints one line per kernel (identical, differs, only before, only after) and
exits non-zero unless every kernel is identical.
"""
import argparse
import pathlib
import re
import shutil
import subprocess
import sys

# Old names (before csrc/cuda was split into one file per kernel) to new ones.
RENAMES = {
    "cluster_sample_kernel": "fp32_smem_kernel",
    "tiled_sample_kernel": "tf32x3_tiled_kernel",
    "wgmma_sample_kernel": "bf16_wgmma_kernel",
    "split_sample_kernel": "bf16x3_wgmma_m64_kernel",
    "narrow_sample_kernel": "bf16x3_wgmma_swapab_kernel",
    "resident_sample_kernel": "fp32_resident_kernel",
    "ClusterPlan": "SmemPlan",
}


def find_cuobjdump(explicit):
    if explicit:
        return explicit
    found = shutil.which("cuobjdump")
    if found:
        return found
    try:  # triton's wheel ships one
        import triton  # noqa: F401
        candidate = pathlib.Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
        if candidate.exists():
            return str(candidate)
    except ImportError:
        pass
    sys.exit("compare_sass.py: no cuobjdump found (pass --cuobjdump)")


def binaries(path):
    path = pathlib.Path(path)
    return sorted(path.rglob("*.o")) if path.is_dir() else [path]


def demangle(names):
    out = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True, check=True).stdout
    return out.splitlines()


def renamed(text):
    for old, new in RENAMES.items():
        text = re.sub(rf"\b{old}\b", new, text)
    return text


def kernels(cuobjdump, path):
    """{renamed demangled kernel name: [instruction lines]} of every binary under path."""
    bodies = {}
    for binary in binaries(path):
        sass = subprocess.run([cuobjdump, "-sass", str(binary)], capture_output=True, text=True).stdout
        name = None
        for line in sass.splitlines():
            header = re.match(r"\s*Function : (\S+)", line)
            if header:
                name = header.group(1)
                bodies[name] = []
            elif name is not None and re.match(r"\s*/\*[0-9a-f]{4,}\*/|\s*/\* 0x", line):
                bodies[name].append(" ".join(line.split()))  # cuobjdump pads to the file's widest line
    mangled = list(bodies)
    pretty = demangle(mangled)
    symbols = re.compile(r"_Z\w+")

    def normalise(line):
        return symbols.sub(lambda m: renamed(demangle([m.group(0)])[0]), line)

    return {renamed(p): [normalise(line) for line in bodies[m]] for m, p in zip(mangled, pretty)}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("before")
    parser.add_argument("after")
    parser.add_argument("--cuobjdump", help="the cuobjdump to use (default: on PATH, else triton's)")
    args = parser.parse_args()
    cuobjdump = find_cuobjdump(args.cuobjdump)
    before, after = kernels(cuobjdump, args.before), kernels(cuobjdump, args.after)
    failed = 0
    for name in sorted(set(before) | set(after)):
        if name not in after:
            verdict = "only before"
        elif name not in before:
            verdict = "only after"
        elif before[name] == after[name]:
            verdict = f"identical ({len(before[name]) // 2} instructions)"
        else:
            verdict = "differs"
        failed += not verdict.startswith("identical")
        print(f"{verdict:32} {name}")
    print(f"{len(set(before) | set(after)) - failed} identical, {failed} not")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
