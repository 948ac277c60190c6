"""Old module names that keep working after a move: `python -m OLD ...` runs the module's new
place (with a note naming it on stderr), and `import OLD` gives the module itself.

A package installs its table of moved modules from its __init__.py (`install(MOVED)`), so the
commands users scripted before a reorganisation still run, and the new names are the ones shown.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
from typing import Optional


class MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, moved: dict[str, str]):
        self.moved = moved
        self._specs = {}  # new name → the module's own spec, while the import of its old name runs

    def new_name(self, name: str) -> Optional[str]:
        """Where `name` lives now (a moved package's submodules move with it), or None."""
        for old, new in self.moved.items():
            if name == old or name.startswith(old + "."):
                return new + name[len(old):]
        return None

    def find_spec(self, name, path=None, target=None):
        new = self.new_name(name)
        if new is None:
            return None
        found = importlib.util.find_spec(new)
        return importlib.util.spec_from_loader(name, self, origin=found.origin,
                                               is_package=found.submodule_search_locations is not None)

    def create_module(self, spec):
        module = importlib.import_module(self.new_name(spec.name))
        self._specs[module.__name__] = module.__spec__
        return module

    def exec_module(self, module) -> None:
        """Nothing to run (the module ran under its new name); give it back its own spec, which the
        import of the old name replaced (importlib sets __spec__ on whatever create_module returns)."""
        module.__spec__ = self._specs.pop(module.__name__)

    def get_code(self, name: str):
        """What runpy runs for `python -m OLD` (a moved package's __main__ included)."""
        new = self.new_name(name)
        print(f"note: {name.removesuffix('.__main__')} is now {new.removesuffix('.__main__')}", file=sys.stderr)
        return importlib.util.find_spec(new).loader.get_code(new)


def install(moved: dict[str, str]) -> None:
    """Make the old names of `moved` (old → new dotted name) importable and runnable, once."""
    if not any(isinstance(finder, MovedModules) and finder.moved == moved for finder in sys.meta_path):
        # First: a moved package's submodules would otherwise be found through its new __path__.
        sys.meta_path.insert(0, MovedModules(moved))
