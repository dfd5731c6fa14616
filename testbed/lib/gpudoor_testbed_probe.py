"""Import hook: point SkyPilot's connectivity probe at a loopback server (test bed only).

testbed/up.sh copies this module into the venv's site-packages together with
``gpudoor_testbed_probe.pth`` (one line: ``import gpudoor_testbed_probe``), so it runs at
interpreter start-up in every process of the venv: the API server, the consolidated
managed-jobs controllers it spawns, and clients. It does nothing unless
``GPUDOOR_TESTBED_PROBE_URL`` is set.

When set, the first import of ``sky.backends.backend_utils`` is followed by
``backend_utils._TEST_IP_LIST = [GPUDOOR_TESTBED_PROBE_URL]``. Stock SkyPilot sends HEAD
requests to https://8.8.8.8 and https://1.1.1.1 there before each cluster status refresh;
with no route out the managed-jobs controller loops on "Network is not available" and jobs
never leave RUNNING. The test bed must not send traffic off the machine at all, so the
probe goes to testbed/lib/probe_server.py, which answers 200.
"""

import importlib.abc
import os
import sys

_ENV = "GPUDOOR_TESTBED_PROBE_URL"
_TARGET = "sky.backends.backend_utils"


def _patch(module) -> None:
    module._TEST_IP_LIST = [os.environ[_ENV]]


class _PatchingLoader(importlib.abc.Loader):
    def __init__(self, wrapped):
        self._wrapped = wrapped

    def create_module(self, spec):
        return self._wrapped.create_module(spec)

    def exec_module(self, module):
        self._wrapped.exec_module(module)
        _patch(module)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname != _TARGET:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _PatchingLoader(spec.loader)
                return spec
        return None


def _install() -> None:
    if not os.environ.get(_ENV):
        return
    already = sys.modules.get(_TARGET)
    if already is not None:
        _patch(already)
        return
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())


_install()
