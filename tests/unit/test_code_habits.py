"""Lint-as-test: device-specific calls live only in the platform package; no print in the library."""

import pathlib
import re
import subprocess

ROOT = pathlib.Path(__file__).resolve().parents[2]

# Built from pieces so that this file does not match itself.
_CUDA, _NCCL = "cu" + "da", "nc" + "cl"
DEVICE_PATTERNS = {
    "tensor-to-device method": re.compile(r"\." + _CUDA + r"\(\)"),
    "device namespace": re.compile(r"\btorch\." + _CUDA + r"\."),
    "backend literal": re.compile(r"[\"']" + _NCCL + r"[\"']"),
}
# The platform package is where devices are named; its tests mirror it.
DEVICE_ALLOWED = ("megatron_gkd/platform/", "tests/unit/platform/")
LIBRARY = ("megatron_gkd/", "models/", "parallel/")


def _python_files() -> list[str]:
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "*.py"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    return [path for path in listed if (ROOT / path).is_file()]


def _code_lines(path: str):
    for number, line in enumerate((ROOT / path).read_text(errors="replace").splitlines(), 1):
        if not line.strip().startswith("#"):
            yield number, line


def test_python_files_are_found():
    files = _python_files()
    assert "megatron_gkd/platform/__init__.py" in files
    assert "tests/unit/test_code_habits.py" in files


def test_device_calls_only_in_platform_package():
    offenders = []
    for path in _python_files():
        if path.startswith(DEVICE_ALLOWED):
            continue
        for number, line in _code_lines(path):
            for name, pattern in DEVICE_PATTERNS.items():
                if pattern.search(line):
                    offenders.append(f"{path}:{number}: {name}: {line.strip()}")
    assert not offenders, "device-specific code outside megatron_gkd/platform/:\n" + "\n".join(offenders)


def test_no_print_in_library_code():
    offenders = [
        f"{path}:{number}: {line.strip()}"
        for path in _python_files()
        if path.startswith(LIBRARY)
        for number, line in _code_lines(path)
        if re.match(r"\s*print\(", line)
    ]
    assert not offenders, "use logging in library code:\n" + "\n".join(offenders)


def test_lint_catches_a_violation(tmp_path):
    sample = f"x = t.{_CUDA}()\nbackend = '{_NCCL}'\ny = torch.{_CUDA}.current_device()\n"
    hits = {name for line in sample.splitlines() for name, p in DEVICE_PATTERNS.items() if p.search(line)}
    assert hits == set(DEVICE_PATTERNS)
