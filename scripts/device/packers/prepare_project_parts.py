"""Carry oneloop's own locked runtime dependencies to the device machine (issue 20, part 1).

    python scripts/device/packers/prepare_project_parts.py [--device-list FILE] [--out-prefix .wp]

Reads the lock (`uv export --frozen --no-dev` of `uv.lock`: exact versions), evaluates each line's
marker for CPython 3.12 on Linux x86_64, and keeps what the device image lacks: every package not
named in the device's package list (`../shared/device/device_pkgs.txt`), not part of the GPU stack
the image provides (torch, triton, nvidia-*, cuda-*), and not already carried by the GPU parts
(`.w1`-`.w3`: megatron-core, vLLM and its dependencies, Ray). Those are downloaded as wheels for
the device (`pip download --no-deps --only-binary=:all:`, the lock's versions) and laid out in
folders `.wp1`, `.wp2`, ... of at most `--part-mib` each, so that each fits one device call's
64 MiB with the working tree. `gpu_run.sh setup_project` installs one folder per call
(`PART=1`, `PART=2`, ...) after setup1-3; pip's `--target` keeps what the GPU parts installed
first (vLLM's pins win over ours where both carry a package).

Prints what it carries, the folder sizes and the number of device calls the install takes.
"""

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[3]
DEVICE_LIST = ROOT.parent / "shared" / "device" / "device_pkgs.txt"
GPU_STACK = re.compile(r"^(torch|torchvision|torchaudio|triton|nvidia-.*|cuda-.*)$")
GPU_PARTS = (".w1", ".w2", ".w3")
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
             "manylinux_2_31_x86_64", "manylinux_2_34_x86_64", "manylinux_2_35_x86_64",
             "manylinux_2_27_x86_64", "manylinux_2_24_x86_64", "manylinux1_x86_64")  # fmt: skip
DEVICE_ENV = dict(
    default_environment(),
    python_version="3.12",
    python_full_version="3.12.3",
    platform_machine="x86_64",
    sys_platform="linux",
    platform_system="Linux",
    os_name="posix",
    implementation_name="cpython",
    platform_python_implementation="CPython",
    extra="",
)


def norm(name: str) -> str:
    """A distribution name in its normal form (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def locked_requirements() -> list[Requirement]:
    """The lock's runtime packages (default groups, no dev, not the project itself) whose marker
    holds on the device."""
    uv = shutil.which("uv") or str(ROOT / ".tools" / "bin" / "uv")
    text = subprocess.run(
        [uv, "export", "--frozen", "--no-dev", "--no-hashes", "--no-emit-project",
         "--format", "requirements-txt"],
        cwd=ROOT, check=True, capture_output=True, text=True,
    ).stdout  # fmt: skip
    out = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#") or line.startswith("-"):
            continue
        req = Requirement(line)
        if req.marker is None or req.marker.evaluate(DEVICE_ENV):
            out.append(req)
    return out


def carried_by_gpu_parts() -> set[str]:
    """Names of the wheels the GPU parts already carry (their file names' first field)."""
    names = set()
    for part in GPU_PARTS:
        for wheel in (ROOT / part).rglob("*.whl"):
            names.add(norm(wheel.name.split("-")[0]))
    return names | {"vllm"}  # vLLM travels split in two (.w1/.w2), not as a .whl file


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--device-list", type=Path, default=DEVICE_LIST,
                        help="names of the packages the device image has, one per line")
    parser.add_argument("--out-prefix", default=".wp", help="folders <prefix>1, <prefix>2, ...")
    parser.add_argument("--part-mib", type=float, default=58.0,
                        help="largest folder (the working tree rides along in the same 64 MiB)")
    args = parser.parse_args()
    if not args.device_list.is_file():
        print(f"error: --device-list {args.device_list}: no such file (one package name per line)",
              file=sys.stderr)  # fmt: skip
        return 2
    missing = [p for p in GPU_PARTS if not (ROOT / p).is_dir()]
    if missing:
        print(f"error: build the GPU parts first ({', '.join(missing)} missing): "
              "../shared/device/prepare_parts.sh", file=sys.stderr)  # fmt: skip
        return 2
    on_device = {norm(n) for n in args.device_list.read_text().split() if n.strip()}
    skip = on_device | carried_by_gpu_parts()
    wanted = [r for r in locked_requirements()
              if norm(r.name) not in skip and not GPU_STACK.match(norm(r.name))]  # fmt: skip
    pins = [f"{r.name}{r.specifier}" for r in wanted]
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
               "--python-version", "3.12", "--implementation", "cp", "-d", tmp]  # fmt: skip
        for platform in PLATFORMS:
            cmd += ["--platform", platform]
        subprocess.run(cmd + pins, check=True)
        wheels = sorted(Path(tmp).glob("*.whl"), key=lambda p: -p.stat().st_size)
        got = {norm(w.name.split("-")[0]) for w in wheels}
        lost = sorted(norm(r.name) for r in wanted if norm(r.name) not in got)
        if lost:
            print(f"error: no wheel downloaded for {lost}", file=sys.stderr)
            return 1
        limit = int(args.part_mib * 2**20)
        parts: list[list[Path]] = []
        sizes: list[int] = []
        for wheel in wheels:  # first fit, largest first
            size = wheel.stat().st_size
            if size > limit:
                print(
                    f"error: {wheel.name} is {size / 2**20:.1f} MiB, over --part-mib",
                    file=sys.stderr,
                )
                return 1
            for i, used in enumerate(sizes):
                if used + size <= limit:
                    parts[i].append(wheel)
                    sizes[i] += size
                    break
            else:
                parts.append([wheel])
                sizes.append(size)
        for old in ROOT.glob(f"{args.out_prefix}[0-9]*"):
            shutil.rmtree(old)
        for i, part in enumerate(parts, start=1):
            folder = ROOT / f"{args.out_prefix}{i}"
            folder.mkdir()
            for wheel in part:
                shutil.copy2(wheel, folder / wheel.name)
            print(f"{folder.name}: {len(part)} wheels, {sizes[i - 1] / 2**20:.1f} MiB")
    print(f"carried ({len(wanted)}): {' '.join(sorted(norm(r.name) for r in wanted))}")
    print(f"device calls to install: {len(parts)} (gpu_run.sh setup_project, PART=1..{len(parts)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
