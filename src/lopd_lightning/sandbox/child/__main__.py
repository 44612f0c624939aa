"""The file the sandbox runs: ``python -s <this file> CONFIG`` (see :mod:`lopd_lightning.sandbox.child`).

Run by path, this folder is no package: :func:`_load` makes it the package ``lopd_sandbox_child`` (so that its
modules import one another relatively, and nothing of ``lopd_lightning`` is imported) and imports every module
at once: later, stage 1 may cover the folder (a checkout under /tmp lies under the program's private ``/tmp``).
"""

import os
import sys
import types


def _load():
    """Make this folder the package ``lopd_sandbox_child`` and return its module ``main`` (which imports every
    other module of the folder). (``importlib.util.spec_from_file_location`` would do the same, at the price of
    its own imports: a few milliseconds more per sandboxed process.)"""
    here = os.path.dirname(os.path.realpath(__file__))
    init = os.path.join(here, "__init__.py")
    package = types.ModuleType("lopd_sandbox_child")
    package.__file__, package.__path__, package.__package__ = init, [here], package.__name__
    sys.modules[package.__name__] = package
    with open(init, "rb") as f:
        exec(compile(f.read(), init, "exec"), package.__dict__)
    from lopd_sandbox_child import main  # a submodule, found on the package's __path__

    return main


if __name__ == "__main__":
    _load().main()
