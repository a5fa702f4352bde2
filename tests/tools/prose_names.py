"""The names prose cites, checked against the repository (tests/test_docs.py): repository paths, the package's dotted
names (``core.kinds.LossKind``, ``ms_gradaccum.cells.accumulating``) and private names (``_TOTALS``), in the README,
docs/, CONTRIBUTING, sample_code's READMEs and the docstrings and comments of the package and the tests. Read from the
source (ast, tokenize), importing nothing: the zoos need not be installed."""
import ast
import importlib.util
import io
import pathlib
import re
import tokenize

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "ms_gradaccum"
TOP = ("ms_gradaccum", "tests", "docs", "sample_code", "benchmarks", ".ci")
PATH = re.compile(r"(?<![\w./-])((?:%s)/[\w./*<>-]*[\w*>])(::\w+)?" % "|".join(re.escape(top) for top in TOP))
# A file named alone (`kinds.py`), or a path inside the package (core/kinds.py); files of other kinds are left alone.
FILE = re.compile(r"`(\w+\.(?:py|md))`")
INNER = re.compile(r"(?<![\w./-])((?:%s)/[\w./-]*\.py)\b" % "|".join(
    sorted({path.parent.name for path in PACKAGE.rglob("*.py")} - {"ms_gradaccum"})))
OTHER_FILE = re.compile(r"(?<![\w/])[\w./-]+\.(?:py|md|log|json|yaml|ckpt|npz|txt|png|toml|sh|ir)\b")
FENCE = re.compile(r"^```.*?^```", re.M | re.S)
# Libraries whose private names and files the package's prose cites: read from their source where installed.
LIBRARIES = ("mindspore", "mindformers", "mindcv", "mindone", "mindocr")
DOTTED = re.compile(r"(?<![\w.])([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+)")
PRIVATE = re.compile(r"(?<![\w./-])(_[A-Za-z]\w*)")


def prose_files() -> list:
    """The prose files: the README, CONTRIBUTING, docs/ and sample_code's READMEs."""
    files = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").glob("*.md"))]
    return files + sorted((ROOT / "sample_code").rglob("README.md"))


def code_files() -> list:
    """The package's and the tests' Python files (this one cites stale names as examples)."""
    files = sorted(PACKAGE.rglob("*.py")) + sorted((ROOT / "tests").rglob("*.py"))
    return [path for path in files if path != pathlib.Path(__file__).resolve()]


def library_dirs() -> list:
    """The installed LIBRARIES' source folders (found, not imported)."""
    dirs = []
    for name in LIBRARIES:
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.submodule_search_locations:
            dirs.extend(pathlib.Path(location) for location in spec.submodule_search_locations)
    return dirs


def prose_of_code(text: str) -> str:
    """A Python file's docstrings and comments (what it says, not what it does)."""
    parts = [token.string for token in tokenize.generate_tokens(io.StringIO(text).readline)
             if token.type == tokenize.COMMENT]
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc:
                parts.append(doc)
    return "\n".join(parts)


def _defined(tree: ast.AST) -> set:
    """Every name a module defines anywhere: functions, classes, arguments, assigned names and attributes."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.arg):
            names.add(node.arg)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
        elif isinstance(node, ast.alias):
            names.add((node.asname or node.name).split(".")[0])
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.isidentifier():
            names.add(node.value)   # setattr(x, "_name", ...), object.__setattr__
    return names


def _installed(name: str) -> bool:
    """Whether `name` is a top-level package installed here (found, not imported)."""
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


class Index:
    """What exists: the package's modules (by dotted path and by last name) and every name defined in the package,
    the tests and MindSpore."""

    def __init__(self):
        self.modules = {}
        for path in PACKAGE.rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            parts = parts[:-1] if parts[-1] == "__init__" else parts
            self.modules[".".join(parts)] = path
        self.trees = {name: ast.parse(path.read_text()) for name, path in self.modules.items()}
        self.names = set()
        for tree in self.trees.values():
            self.names |= _defined(tree)
        for path in (ROOT / "tests").rglob("*.py"):
            self.names |= _defined(ast.parse(path.read_text()))
        self.names |= {path.stem for path in ROOT.rglob("*.py")}
        self.files = {path.name for path in ROOT.rglob("*") if ".git" not in path.parts}
        self._library = None

    def library_names(self) -> tuple:
        """``(identifiers, file names)`` in the installed libraries' source (what the prose cites of
        MindSpore and the zoos)."""
        if self._library is None:
            words, files = set(), set()
            for folder in library_dirs():
                for path in folder.rglob("*.py"):
                    files.add(path.name)
                    words |= set(re.findall(r"\b[A-Za-z_]\w*", path.read_text(errors="replace")))
            self._library = words, files
        return self._library

    def library_path(self, relative: str) -> bool:
        """Whether an installed library has a file at `relative` inside it (mindformers' core/clip_grad.py)."""
        return any((folder / relative).exists() for folder in library_dirs())

    def file_ok(self, name: str) -> bool:
        return name in self.files or name in self.library_names()[1]

    def module_of(self, parts: list):
        """``(module, rest)``: the longest package module `parts` start with (a dotted path from the package, with or
        without ``ms_gradaccum.``, or a module's last name where one module has it), else None."""
        if parts[0] != "ms_gradaccum" and _installed(parts[0]):
            return None   # another library's (mindone.diffusers is not ms_gradaccum.mindone's)
        for dotted, least in ((parts, 1), (["ms_gradaccum"] + parts, 2)):
            for end in range(len(dotted), least - 1, -1):
                name = ".".join(dotted[:end])
                if name in self.modules:
                    return name, dotted[end:]
        by_last = [name for name in self.modules if name.split(".")[-1] == parts[0]]
        if len(by_last) == 1 and len(parts) > 1:
            return by_last[0], parts[1:]
        return None

    def dotted_ok(self, token: str, local: set) -> bool:
        """Whether a dotted name is the package's and exists (others, MindSpore's or the zoos', are not checked);
        `local`: the names the citing file imports (an alias, ``_buffers.normalise``)."""
        parts = token.split(".")
        head = parts[0]
        if head in local and head not in self.modules and not head.startswith("_"):
            return True   # a name of the citing file (self.x, np.x): not a package path
        found = self.module_of(parts)
        if found is None:
            stripped = head.lstrip("_")
            if head.startswith("_") and head != "_mindspore" and self.module_of([stripped, "x"]) is not None:
                return head in local   # _engine.X: the module is core.engine now, unless the file imports it so
            if head.startswith("_"):
                # Prose names the package's modules by their paths (core.engine, not _engine); a private head is
                # the citing file's own name, or a library's module (mindspore's _checkparam).
                return head in local or head + ".py" in self.library_names()[1] or self.library_path(head)
            return True   # not the package's
        module, rest = found
        if not rest:
            return True
        defined = _defined(self.trees[module])
        return rest[0] in defined and all(name in self.names for name in rest[1:])

    def private_ok(self, name: str, local: set) -> bool:
        return name in local or name in self.names or name in self.library_names()[0]


def stale_names(text: str, index: Index, local: frozenset = frozenset()) -> list:
    """The names `text` cites that do not exist: ``[(kind, name), ...]``."""
    stale = []
    for match in PATH.finditer(text):
        path, member = match.group(1).rstrip("."), match.group(2)
        pattern = re.sub(r"<[^>]*>", "*", path)
        targets = list(ROOT.glob(pattern)) if "*" in pattern else [ROOT / path]
        if not targets or not all(target.exists() for target in targets):
            stale.append(("path", path))
        elif member and targets[0].suffix == ".py" and member[2:] not in _defined(ast.parse(targets[0].read_text())):
            stale.append(("path", path + member))
    text = PATH.sub(" ", text)
    for match in INNER.finditer(text):
        if not (PACKAGE / match.group(1)).exists() and not index.library_path(match.group(1)):
            stale.append(("path", match.group(1)))
    text = INNER.sub(" ", text)
    for match in FILE.finditer(text):
        if not index.file_ok(match.group(1)):
            stale.append(("file", match.group(1)))
    text = OTHER_FILE.sub(" ", text)
    for match in DOTTED.finditer(text):
        token = match.group(1)
        if not index.dotted_ok(token, local):
            stale.append(("name", token))
    for match in PRIVATE.finditer(DOTTED.sub(" ", text)):
        name = match.group(1)
        if not index.private_ok(name, local):
            stale.append(("name", name))
    return stale


def every_stale_name() -> dict:
    """``{file: [(kind, name), ...]}`` over the prose of the repository."""
    index, found = Index(), {}
    for path in prose_files():
        stale = stale_names(FENCE.sub(" ", path.read_text()), index)   # code blocks are run by tests
        if stale:
            found[str(path.relative_to(ROOT))] = stale
    for path in code_files():
        text = path.read_text()
        stale = stale_names(prose_of_code(text), index, frozenset(_defined(ast.parse(text))))
        if stale:
            found[str(path.relative_to(ROOT))] = stale
    return found


if __name__ == "__main__":
    for file, names in every_stale_name().items():
        print(file, sorted(set(names)))
