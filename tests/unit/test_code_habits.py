"""Lint-as-test: device-specific calls live only in the platform package; no print in the library."""

import ast
import importlib
import pathlib
import re
import subprocess

ROOT = pathlib.Path(__file__).resolve().parents[2]

# Built from pieces so that this file does not match itself.
_CUDA, _NCCL = "cu" + "da", "nc" + "cl"
_NPU, _HCCL = "n" + "pu", "hc" + "cl"
DEVICE_PATTERNS = {
    "tensor-to-device method": re.compile(r"\.(?:" + _CUDA + "|" + _NPU + r")\("),
    "device namespace": re.compile(r"\b(?:torch|torch_" + _NPU + r")\.(?:" + _CUDA + "|" + _NPU + r")\b"),
    "backend literal": re.compile(r"[\"'](?:" + _NCCL + "|" + _HCCL + r")[\"']"),
    "device-string literal": re.compile(r"[\"'](?:" + _CUDA + "|" + _NPU + r")(?::\d+)?[\"']"),
    "vendor import": re.compile(r"^\s*(?:import|from)\s+(?:torch_" + _NPU + r"|mindspeed)\b"),
}
# Every Python package of the tree is linted; a new top-level folder must be added here on purpose.
LINTED_ROOTS = ("megatron_gkd/", "models/", "parallel/", "launch/", "benchmarks/", "scripts/", "tests/")
# The platform package is where devices are named; its tests mirror it.
# setup.py names its install extras after the platforms (packaging metadata, not device code).
DEVICE_ALLOWED = ("megatron_gkd/platform/", "tests/unit/platform/", "setup.py")
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
    roots = {path.split("/")[0] + "/" for path in files if "/" in path}
    assert roots <= set(LINTED_ROOTS), f"python outside the linted roots: {sorted(roots - set(LINTED_ROOTS))}"
    for root in ("megatron_gkd/", "models/", "parallel/", "launch/", "benchmarks/"):
        assert any(path.startswith(root) for path in files), root


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


# A command line's output is its interface (the teacher service's READY line, the trainer's summary line and
# config errors, which scripts and tests read): it prints.
COMMAND_LINES = ("/cli.py", "/__main__.py")


def test_no_print_in_library_code():
    offenders = [
        f"{path}:{number}: {line.strip()}"
        for path in _python_files()
        if path.startswith(LIBRARY) and not path.endswith(COMMAND_LINES)
        for number, line in _code_lines(path)
        if re.match(r"\s*print\(", line)
    ]
    assert not offenders, "use logging in library code:\n" + "\n".join(offenders)


def test_lint_catches_a_violation(tmp_path):
    sample = (f"x = t.{_CUDA}()\nbackend = '{_NCCL}'\ny = torch.{_CUDA}.current_device()\n"
              f"d = '{_NPU}:0'\nimport torch_{_NPU}\n")
    hits = {name for line in sample.splitlines() for name, p in DEVICE_PATTERNS.items() if p.search(line)}
    assert hits == set(DEVICE_PATTERNS)
    for line in (f"x = t.{_NPU}(1)", f"g = '{_HCCL}'", f"torch.{_NPU}.set_device(0)", f"torch_{_NPU}.{_NPU}.synchronize()",
                 f"z.to('{_CUDA}')", "from mindspeed import megatron_adaptor"):
        assert any(p.search(line) for p in DEVICE_PATTERNS.values()), line
    # Words that merely contain the letters are not device code.
    for line in ("inputs = self.input_ids", "a = t.cuda_graphs_enabled", "x = 'npus'"):
        assert not any(p.search(line) for p in DEVICE_PATTERNS.values()), line


# Notes that live outside the repository (the team's shared pages); a clone has none of them.
OUTSIDE_NOTES = re.compile(r"\b(?:DESIGN|ENVIRONMENT|STYLE)\.md\b|\.\./shared\b")


def test_nothing_cites_a_file_outside_the_repository():
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "*.py", "*.md", "*.yaml",
                             "*.sh"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    found = [f"{path}:{number}" for path in listed if (ROOT / path).is_file() and path != "tests/unit/test_code_habits.py"
             for number, line in enumerate((ROOT / path).read_text(errors="replace").splitlines(), 1)
             if OUTSIDE_NOTES.search(line)]
    assert not found, "cite docs/design.md or state the fact instead: " + ", ".join(found)
    assert OUTSIDE_NOTES.search("see ../shared/DESIGN.md") and not OUTSIDE_NOTES.search("see docs/design.md")


def _imports(path: str) -> list[str]:
    """Every module imported anywhere in ``path`` (function-level imports too)."""
    tree = ast.parse((ROOT / path).read_text())
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append(node.module)
    return found


def test_config_does_not_import_the_trainer():
    """``trainer/`` builds on ``config/``; an import back up makes a cycle (what both need lives below both)."""
    offenders = [f"{path}: imports {module}" for path in _python_files() if path.startswith("megatron_gkd/config/")
                 for module in _imports(path) if module == "megatron_gkd.trainer" or module.startswith("megatron_gkd.trainer.")]
    assert not offenders, "\n".join(offenders)


def _code_strings(path: str) -> list[tuple[int, str]]:
    """String constants of ``path`` that are not docstrings."""
    tree = ast.parse((ROOT / path).read_text())
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                  and node.body and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}
    return [(node.lineno, node.value) for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings]


def _names_a_script(value: str) -> bool:
    return value.startswith("launch/") or bool(re.fullmatch(r"[\w./-]*\w\.py", value))


def test_library_runs_modules_not_scripts_by_path():
    """The library starts its own commands with ``python -m`` (``launch/*.py`` are thin entry points for
    users): a path into the source tree breaks once the package is installed."""
    offenders = [f"{path}:{line}: {value!r}" for path in _python_files() if path.startswith(LIBRARY)
                 for line, value in _code_strings(path) if _names_a_script(value)]
    assert not offenders, "\n".join(offenders)


def test_layering_lints_catch_violations():
    assert _names_a_script("launch/pretrain_gkd.py") and _names_a_script("teacher_server.py")
    assert not _names_a_script("megatron_gkd.trainer.cli") and not _names_a_script("a .py file")


def _uses_megatron_parallel_state(path: str) -> bool:
    for node in ast.walk(ast.parse((ROOT / path).read_text())):
        if isinstance(node, ast.Import) and any(a.name.startswith("megatron.core.parallel_state") for a in node.names):
            return True
        if isinstance(node, ast.ImportFrom) and node.module == "megatron.core" and any(
                a.name == "parallel_state" for a in node.names):
            return True
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("megatron.core.parallel_state"):
            return True
    return False


def test_process_groups_come_from_the_parallel_state():
    """Megatron-Core's ``parallel_state`` getters are read in ``parallel/`` (which builds the groups) and
    ``platform/`` only; the library takes every group and coordinate from ``ParallelState``."""
    offenders = [path for path in _python_files() if path.startswith(LIBRARY)
                 and not path.startswith(("parallel/", "megatron_gkd/platform/")) and _uses_megatron_parallel_state(path)]
    assert not offenders, "use megatron_gkd.parallel's ParallelState instead of Megatron's getters:\n" + "\n".join(offenders)


# Who may look up the process's ParallelState (``parallel.get_state()``): ``parallel/``, which builds it, and the
# entry points, which hand it down (a command line, ``models/convert.py``'s offline conversion, a test workload of
# ``megatron_gkd/testing``). The one exception is ``models/builder.py``: ``build_model`` / ``load_hf`` default to
# it for scripts and tests (``models.load_hf(path)`` after ``parallel.initialize``); library code passes
# ``state=`` (the lint below).
STATE_LOOKUP_ALLOWED = ("parallel/", "launch/", "megatron_gkd/testing/", "models/convert.py", "models/builder.py")
# Library calls that build a model must say on which state.
STATE_TAKERS = ("load_hf", "build_model")


def _is_entry_point(path: str) -> bool:
    return path.startswith(STATE_LOOKUP_ALLOWED) or path.rsplit("/", 1)[-1] in ("cli.py", "__main__.py")


def _state_lookups(source: str) -> list[int]:
    """Lines that call ``parallel.get_state()`` or a ``get_state`` imported from ``megatron_gkd.parallel``."""
    tree = ast.parse(source)
    imported = any(isinstance(node, ast.ImportFrom) and (node.module or "").startswith("megatron_gkd.parallel")
                   and any(alias.name == "get_state" for alias in node.names) for node in ast.walk(tree))
    lines = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        if (isinstance(func, ast.Attribute) and func.attr == "get_state" and isinstance(func.value, ast.Name)
                and func.value.id == "parallel") or (imported and isinstance(func, ast.Name) and func.id == "get_state"):
            lines.append(node.lineno)
    return lines


def _calls_without_state(source: str) -> list[int]:
    """Lines that call :data:`STATE_TAKERS` without ``state=``."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call):
            name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
            if name in STATE_TAKERS and not any(keyword.arg == "state" for keyword in node.keywords):
                lines.append(node.lineno)
    return lines


def test_the_parallel_state_is_passed_not_looked_up():
    """Library code receives the ``ParallelState`` (its groups, the trainer's control group included) from the
    entry point that built it, or from the model it was given (``HFModelInfo.parallel_state``); it does not look
    up the process-wide one."""
    lookups = [f"{path}:{line}" for path in _python_files() if path.startswith(LIBRARY) and not _is_entry_point(path)
               for line in _state_lookups((ROOT / path).read_text())]
    assert not lookups, "take the ParallelState as an argument (or from the model) instead of parallel.get_state():\n" \
        + "\n".join(lookups)
    unsaid = [f"{path}:{line}" for path in _python_files() if path.startswith(LIBRARY) and not _is_entry_point(path)
              for line in _calls_without_state((ROOT / path).read_text())]
    assert not unsaid, "pass state= to " + " / ".join(STATE_TAKERS) + ":\n" + "\n".join(unsaid)
    groups = [f"{path}:{number}" for path in _python_files() if path.startswith(LIBRARY)
              and not path.startswith(("parallel/", "megatron_gkd/weight_sync/", "megatron_gkd/rollout/remote.py"))
              for number, line in _code_lines(path) if "new_group(" in line]
    assert not groups, "process groups are built in parallel/ (ParallelState), not here:\n" + "\n".join(groups)


def test_state_lint_catches_violations():
    assert _state_lookups("from megatron_gkd import parallel\nstate = parallel.get_state()\n") == [2]
    assert _state_lookups("from megatron_gkd.parallel import get_state\nget_state()\n") == [2]
    assert _state_lookups("import numpy as np\nnp.random.get_state()\n") == []
    assert _calls_without_state("load_hf(path, dtype=d)\nmodels.build_model(c, state=s)\n") == [1]


_MODE_NAMES = r"(?:on_policy|off_policy|sft|route|mixture)"
MODE_COMPARISON = re.compile(r"\bmode\s*(?:[!=]=\s*[\"']" + _MODE_NAMES + r"[\"']|(?:not\s+)?in\s*\(\s*[\"']" + _MODE_NAMES + ")")
# The classes that own a mode's name: the trainer modes' table and the teacher mix's section.
MODE_OWNERS = ("megatron_gkd/config/schema.py", "megatron_gkd/teacher/config.py")


def test_modes_are_asked_not_compared():
    """Code asks ``config.trainer.run_mode`` (samples? distils?) and ``teacher_mix.is_routed`` what a mode does;
    only the classes that own the names compare them."""
    offenders = [f"{path}:{number}: {line.strip()}" for path in _python_files()
                 if path.startswith(LIBRARY) and path not in MODE_OWNERS
                 for number, line in _code_lines(path) if MODE_COMPARISON.search(line)]
    assert not offenders, "\n".join(offenders)
    assert MODE_COMPARISON.search('if config.trainer.mode == "sft":') and MODE_COMPARISON.search("mode in ('on_policy',")
    assert not MODE_COMPARISON.search('spec.mode == "union"')


CLIENT_COMPARISON = re.compile(r"\bclient\s*(?:[!=]=\s*[\"']\w+[\"']|(?:not\s+)?in\s*\(\s*[\"'])")


def test_teacher_clients_are_asked_not_compared():
    """What a teacher client needs and can do is declared where it is registered (``ClientTraits``); the
    config's checks, the planner and the trainer ask ``client_traits(name)``, never compare the name."""
    offenders = [f"{path}:{number}: {line.strip()}" for path in _python_files() if path.startswith(LIBRARY)
                 for number, line in _code_lines(path) if CLIENT_COMPARISON.search(line)]
    assert not offenders, "\n".join(offenders)
    assert CLIENT_COMPARISON.search('teacher.client == "openai"') and CLIENT_COMPARISON.search("client in ('none',")


BACKEND_COMPARISON = re.compile(r"\bbackend\s*(?:[!=]=\s*[\"']\w+[\"']|(?:not\s+)?in\s*(?:[\(\[\{]\s*[\"']|_?[A-Z]))")
# Where the checks and the trainer decide what a teacher backend can do. (The launcher's deployment recipes are per
# backend by nature: a torchrun per node, a Ray cluster, one process; platform/ and the weight-sync transports
# compare torch.distributed's backends, another registry.)
BACKEND_ASKERS = ("megatron_gkd/config/", "megatron_gkd/trainer/", "megatron_gkd/planning/", "megatron_gkd/teacher/clients/")


def test_teacher_backends_are_asked_not_compared():
    """What a teacher backend can do is declared where it is registered (``BackendTraits``); the config's checks and
    the trainer ask ``backend_traits(name)``, never compare the name or key a table on it."""
    offenders = [f"{path}:{number}: {line.strip()}" for path in _python_files()
                 if path.startswith(BACKEND_ASKERS)
                 for number, line in _code_lines(path) if BACKEND_COMPARISON.search(line)]
    assert not offenders, "\n".join(offenders)
    assert BACKEND_COMPARISON.search('if backend == "vllm":') and BACKEND_COMPARISON.search("backend in _TEMPERATURE_ONE")
    assert BACKEND_COMPARISON.search("serve.backend not in ('hf',") and not BACKEND_COMPARISON.search('backend == other')


# Names the code chooses by (issue 31 item 3). A name of one of these closed sets is compared (``==``, ``!=``,
# ``in``, ``not in``, or in a module-level table) only in the modules that own it; elsewhere code asks the
# member or the traits what the choice needs (``teacher.signal.needs_head``, ``engine_traits(name)``).
CHOICE_TYPES = ("megatron_gkd/teacher/protocol/types.py:Signal", "megatron_gkd/rollout/types.py:Layout",
                "megatron_gkd/config/schema.py:LossKind", "megatron_gkd/xtok/config.py:HiddenSupport")
# Registries whose names are checked: (module:REGISTRY, the owners, beyond which its names are not compared).
CHECKED_REGISTRIES = {
    "megatron_gkd/rollout/registry.py:ENGINES": ("megatron_gkd/rollout/registry.py",),
    "megatron_gkd/teacher/clients/__init__.py:CLIENTS": ("megatron_gkd/teacher/clients/__init__.py",),
    # The launcher's deployment recipes are per backend by nature (a torchrun per node, a Ray cluster, one process).
    "megatron_gkd/teacher/backends/__init__.py:BACKENDS": ("megatron_gkd/teacher/backends/", "megatron_gkd/launcher/"),
    "megatron_gkd/weight_sync/transports.py:TRANSPORTS": ("megatron_gkd/weight_sync/transports.py",),
    # losses/ writes each divergence in its several forms by name: on the teacher's support and over the whole
    # vocabulary where it is registered (divergences.py, with TCAD's inner divergence), over a cross-tokenizer
    # teacher's whole vocabulary (cross_vocab/hidden.py), and as the float64 references, written apart from the code
    # they check (reference.py); the loss tests' non-default options of some (testing/divergence_cases.py). The config
    # checks and the trainer ask the registered Divergence what it needs.
    "megatron_gkd/losses/registry.py:DIVERGENCES": ("megatron_gkd/losses/registry.py", "megatron_gkd/losses/divergences.py",
                                                    "megatron_gkd/losses/cross_vocab/hidden.py",
                                                    "megatron_gkd/losses/reference.py",
                                                    "megatron_gkd/testing/divergence_cases.py"),
    "megatron_gkd/config/schedules.py:SCHEDULERS": ("megatron_gkd/config/schedules.py",),
}
# Registries whose names are everyday words ('loss', 'teacher', 'advantage' name much else in the code): only a
# comparison with the field that holds the choice is checked (``rl.combine == "teacher"``), and no table.
CHECKED_BY_FIELD = {
    "megatron_gkd/losses/combinations.py:COMBINATIONS": ("combine", ("megatron_gkd/losses/combinations.py",)),
    "megatron_gkd/rollout/sources.py:RESPONSE_SOURCES": ("source", ("megatron_gkd/rollout/sources.py",)),
}
# Choices whose names are everyday words, checked against their field as CHECKED_BY_FIELD's registries are.
CHOICES_BY_FIELD: dict[str, tuple[str, tuple[str, ...]]] = {}
# Registries not checked yet, with where their names are still compared (what is left of issue 31 item 3).
UNCHECKED_REGISTRIES = {
    "megatron_gkd/rewards/kinds.py:REWARDS": "not compared today",
    "megatron_gkd/losses/sampled_kl.py:KL_ESTIMATORS": "not compared today",
    "megatron_gkd/losses/advantages.py:ADVANTAGE_ESTIMATORS": "not compared today",
    "megatron_gkd/losses/advantages.py:AGGREGATIONS": "not compared today",
    "models/registry.py:ARCHITECTURES": "HF architecture names, matched by models/",
}
# The same words name other choices in these fields: the launcher's job scheduler ('local'), the planner's kernels
# ('local') and its own Batch.loss ('distill', 'cross_entropy'; planning/ imports nothing of the trainer), Megatron's
# recompute granularity ('full'). A comparison of such a field with such a word is not one of the checked choices.
HOMONYM_FIELDS = {"scheduler": {"local"}, "kernels": {"local"}, "loss": {"distill", "cross_entropy"},
                  "recompute_granularity": {"full"}}
COLLECTIONS = (ast.Tuple, ast.List, ast.Set, ast.Dict)


def _choice_values(spec: str) -> dict[str, tuple[str, ...]]:
    """``{value: (owner,)}`` of a ``Choice`` subclass ``path:Class``, read from its class body."""
    path, name = spec.split(":")
    for node in ast.walk(ast.parse((ROOT / path).read_text())):
        if isinstance(node, ast.ClassDef) and node.name == name:
            return {item.value.value: (path,) for item in node.body if isinstance(item, ast.Assign)
                    and isinstance(item.value, ast.Constant) and isinstance(item.value.value, str)}
    raise AssertionError(f"{spec} is not defined")


def _registry_values(spec: str, owners: tuple[str, ...]) -> dict[str, tuple[str, ...]]:
    path, name = spec.split(":")
    module = importlib.import_module(path.removesuffix(".py").removesuffix("/__init__").replace("/", "."))
    return {value: owners for value in getattr(module, name).names()}


def _chosen_names() -> dict[str, tuple[str, ...]]:
    """Every checked name and the paths (files or folders) that may compare it."""
    names: dict[str, tuple[str, ...]] = {}
    parts = [_choice_values(spec) for spec in CHOICE_TYPES]
    parts += [_registry_values(spec, owners) for spec, owners in CHECKED_REGISTRIES.items()]
    for part in parts:
        for value, owners in part.items():
            names[value] = names.get(value, ()) + owners
    return names


def _names_by_field() -> dict[str, tuple[str, tuple[str, ...]]]:
    """``{name: (field, owners)}`` of the registries checked only against their own field."""
    return {value: (field, owners) for spec, (field, owners) in CHECKED_BY_FIELD.items()
            for value in _registry_values(spec, owners)}


def _choice_names_by_field() -> dict[str, tuple[str, tuple[str, ...]]]:
    """``{name: (field, owners)}`` of the choices checked only against their own field (a word of one may also be a
    word of a registry above, ``teacher``: each set is checked on its own)."""
    return {value: (field, owners) for spec, (field, owners) in CHOICES_BY_FIELD.items()
            for value in _choice_values(spec)}


def _literals(node) -> list[str]:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return [item.value for item in node.elts if isinstance(item, ast.Constant) and isinstance(item.value, str)]
    return []


def _field(node) -> str | None:
    return node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name) else None


def _name_comparisons(source: str, names, by_field=None) -> list[tuple[int, str]]:
    """``(line, name)`` of each comparison with a name of ``names`` (a literal or a literal tuple, list or set on
    either side) or with a name of ``by_field`` (``{name: (field, owners)}``) where one side is that field, and each
    module-level table (a tuple, list, set or dict keys of string literals) of ``names``."""
    found, by_field = [], by_field or {}
    tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare) and all(isinstance(op, (ast.Eq, ast.NotEq, ast.In, ast.NotIn))
                                                 for op in node.ops):
            sides = [node.left, *node.comparators]
            fields = {_field(side) for side in sides}
            homonyms = set().union(*(HOMONYM_FIELDS.get(field, ()) for field in fields))
            found += [(node.lineno, value) for side in sides for value in _literals(side) if value not in homonyms
                      and (value in names or (value in by_field and by_field[value][0] in fields))]
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        if len(targets) == 1 and isinstance(targets[0], ast.Name) and isinstance(node.value, COLLECTIONS):
            table = list(node.value.keys) if isinstance(node.value, ast.Dict) else [node.value]
            values = [value for item in table if item is not None for value in _literals(item)]
            if values and all(value in names for value in values):
                found += [(node.lineno, value) for value in values]
    return found


def test_chosen_names_are_asked_not_compared():
    """A signal, a layout, a loss kind, a rollout engine, a teacher client or backend, a weight-sync transport, a
    divergence, a scheduler, a combination of reward and teacher: its members or traits say what it needs, and only
    the module that defines the name compares it."""
    names, by_field = _chosen_names(), _names_by_field()
    owners = {**{value: owner for value, (_, owner) in by_field.items()}, **names}
    offenders = [f"{path}:{line}: {value!r}" for path in _python_files() if path.startswith(LIBRARY)
                 for line, value in _name_comparisons((ROOT / path).read_text(), names, by_field)
                 if not path.startswith(owners[value])]
    choices = _choice_names_by_field()
    offenders += [f"{path}:{line}: {value!r}" for path in _python_files() if path.startswith(LIBRARY)
                  for line, value in _name_comparisons((ROOT / path).read_text(), {}, choices)
                  if not path.startswith(choices[value][1])]
    assert not offenders, ("ask the choice's member or traits what it needs instead of comparing its name:\n"
                           + "\n".join(offenders))


def test_every_registry_is_placed_in_the_name_lint():
    """A new registry is added on purpose to the checked ones, or to the unchecked ones with the reason."""
    found = {f"{path}:{target.id}" for path in _python_files() if path.startswith(LIBRARY)
             for node in ast.walk(ast.parse((ROOT / path).read_text()))
             if isinstance(node, (ast.Assign, ast.AnnAssign)) and isinstance(node.value, ast.Call)
             and _field(node.value.func) == "Registry"
             for target in (node.targets if isinstance(node, ast.Assign) else [node.target])
             if isinstance(target, ast.Name)}
    assert found == set(CHECKED_REGISTRIES) | set(CHECKED_BY_FIELD) | set(UNCHECKED_REGISTRIES)


def test_name_lint_catches_violations():
    names = {"hidden": ("a.py",), "vllm": ("b.py",), "colocated": ("a.py",), "local": ("c.py",), "sync": ("d.py",)}
    by_field = {"teacher": ("combine", ("e.py",))}
    source = ('if teacher.signal == "hidden": pass\n'                                  # 1
              'x = rollout.layout in ("colocated", "disaggregated")\n'                # 2
              '_ONE = {"vllm", "hidden"}\n'                                           # 3: a table
              'y = "hidden" in info.signals\n'                                        # 4
              'if allocation.scheduler == "local": pass\n'                            # a homonym of the field
              'z = {"hidden": 1, "other": 2}\n'                                       # not all names: not a table
              'A, B = "vllm", "hidden"\n'                                             # constants, not a table
              'SUBDIR = "hidden"\n'
              'if mode == "other": pass\n'
              'if trainer.scheduler not in ("sync", "local"): pass\n'                # 10: not a homonym of the field
              'if config.rl.combine == "teacher": pass\n'                            # 11: checked against its field
              'if mix.source == "teacher": pass\n'                                   # another field: not checked
              '_WORDS = ("teacher",)\n')                                              # no table of field-checked names
    assert _name_comparisons(source, names, by_field) == [(1, "hidden"), (2, "colocated"), (4, "hidden"), (10, "sync"),
                                                          (11, "teacher"), (3, "vllm"), (3, "hidden")]


LOOP = "megatron_gkd/trainer/loop.py"
LOOP_MAX_LINES = 320
# The trainer's parts are built in components.py and passed in: the loop neither sets their members nor reads
# their private ones.
REACHES_INTO = re.compile(r"\bself\.(?:flow|rollout|runner|checkpoints|teachers|evaluator)\.(?:_\w+|\w+\s*=(?!=))")


def test_the_trainer_loop_stays_a_table_of_contents():
    """``trainer/loop.py`` reads as the run's table of contents (issue 22: at most 320 lines); rollout, eval,
    metrics and checkpoints have their owners."""
    lines = (ROOT / LOOP).read_text().splitlines()
    assert len(lines) <= LOOP_MAX_LINES, f"{LOOP} has {len(lines)} lines (at most {LOOP_MAX_LINES}): move a concern out"
    offenders = [f"{LOOP}:{number}: {line.strip()}" for number, line in _code_lines(LOOP) if REACHES_INTO.search(line)]
    assert not offenders, "pass what a part needs when it is built instead:\n" + "\n".join(offenders)
    assert REACHES_INTO.search("self.flow.engine = build()") and REACHES_INTO.search("self.flow._asks, check")
    assert not REACHES_INTO.search("if self.flow.engine == other") and not REACHES_INTO.search("self.flow.prepare(batch)")


STEP, STEP_MAX_LINES = "megatron_gkd/trainer/step.py", 349
FLOW, FLOW_MAX_METHODS = "megatron_gkd/trainer/flow.py", 11


def test_the_batch_path_stays_small():
    """Issue #47: the step runs the terms it is given (``trainer/step.py`` under 350 lines: the terms live in
    ``losses/``), and the flow directs a batch through its owners (``BatchFlow`` under 12 methods: the teacher
    exchange, the annotators, the mixture, the micro-batcher own the rest)."""
    lines = (ROOT / STEP).read_text().splitlines()
    assert len(lines) <= STEP_MAX_LINES, f"{STEP} has {len(lines)} lines (at most {STEP_MAX_LINES}): a term's code " \
                                         "belongs in losses/, a batch's preparation in the micro-batcher"
    [flow] = [node for node in ast.walk(ast.parse((ROOT / FLOW).read_text()))
              if isinstance(node, ast.ClassDef) and node.name == "BatchFlow"]
    methods = [node.name for node in flow.body if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))]
    assert len(methods) <= FLOW_MAX_METHODS, f"BatchFlow has {len(methods)} methods (at most {FLOW_MAX_METHODS}): " \
                                             f"{methods}; give the new concern an owner the flow calls"

# The project's own packages, imported at the top of a module so that its import graph can be read (issue 31). An
# import inside a function stays only with a ``# deferred: <why>`` comment on its line or the line above: a module
# that pulls a heavy optional dependency (megatron.core, vLLM) at import, or an import cycle.
IMPORTS_AT_TOP = ("megatron_gkd/", "models/", "parallel/", "launch/")
OWN_PACKAGES = ("megatron_gkd", "models", "parallel", "launch")
DEFERRED = re.compile(r"#\s*deferred:\s*\S")


def _function_imports(source: str) -> list[tuple[int, str]]:
    """``(line, module)`` of each import of the project's own modules inside a function that no ``# deferred:``
    comment explains (relative imports count as the project's own: ``"."`` + module)."""
    lines = source.splitlines()

    def explained(node) -> bool:
        above = lines[node.lineno - 2].strip() if node.lineno > 1 else ""
        return any(DEFERRED.search(lines[number - 1]) for number in {node.lineno, node.end_lineno}) or (
            above.startswith("#") and bool(DEFERRED.search(above)))

    found = []

    def visit(node, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if in_function and isinstance(child, (ast.Import, ast.ImportFrom)) and not explained(child):
                if isinstance(child, ast.ImportFrom):
                    modules = ["." * child.level + (child.module or "")]
                else:
                    modules = [alias.name for alias in child.names]
                found.extend((child.lineno, module) for module in modules
                             if module.startswith(".") or module.split(".")[0] in OWN_PACKAGES)
            visit(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)))

    visit(ast.parse(source), False)
    return found


def test_the_project_is_imported_at_the_top():
    """A module's own dependencies are listed at its top; a function that imports the project hides an arrow of
    the import graph (and, often, a cycle)."""
    offenders = [f"{path}:{line}: {module}" for path in _python_files() if path.startswith(IMPORTS_AT_TOP)
                 for line, module in _function_imports((ROOT / path).read_text())]
    assert not offenders, ("import the project's modules at the top of the file, or say why not on the line (or the "
                           "line above) with `# deferred: <why>` (a heavy optional dependency, an import cycle):\n"
                           + "\n".join(offenders))


def test_import_lint_catches_violations():
    source = ("from megatron_gkd import config\n"
              "import numpy\n"
              "def f():\n"
              "    from megatron_gkd.data import load_prompts\n"                       # 4: flagged
              "    import json\n"
              "    from . import sibling\n"                                             # 6: flagged
              "    from megatron_gkd.models import mla  # deferred: imports megatron.core\n"
              "    # deferred: import cycle with megatron_gkd.x\n"
              "    import megatron_gkd.y\n"
              "    import parallel.shards  # deferred:\n"                               # 10: no reason given
              "class C:\n"
              "    from models import llama\n"                                          # a class body, not a function
              "    def m(self):\n"
              "        def inner():\n"
              "            from models.builder import (\n"                              # 15: flagged
              "                build_model,\n"
              "            )\n"
              "        from launch import pretrain_gkd\n"                               # 18: flagged
              "        from ..losses import (  # deferred: import cycle with losses\n"
              "            dense)\n")
    assert _function_imports(source) == [(4, "megatron_gkd.data"), (6, "."), (10, "parallel.shards"),
                                         (15, "models.builder"), (18, "launch")]
