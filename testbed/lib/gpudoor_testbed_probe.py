"""Import hook for the test bed's SkyPilot processes: loopback connectivity probe, and short waits.

testbed/up.sh copies this module into the venv's site-packages together with
``gpudoor_testbed_probe.pth`` (one line: ``import gpudoor_testbed_probe``), so it runs at
interpreter start-up in every process of the venv: the API server, the consolidated
managed-jobs controllers it spawns, and clients. It does nothing unless
``GPUDOOR_TESTBED_PROBE_URL`` is set (up.sh sets it for the bed's server and its clients).

1. **The connectivity probe.** When ``sky.backends.backend_utils`` is imported,
   ``_TEST_IP_LIST = [GPUDOOR_TESTBED_PROBE_URL]``. Stock SkyPilot sends HEAD requests to
   https://8.8.8.8 and https://1.1.1.1 there before each cluster status refresh; with no route out
   the managed-jobs controller loops on "Network is not available" and jobs never leave RUNNING.
   The test bed must not send traffic off the machine at all, so the probe goes to
   testbed/lib/probe_server.py, which answers 200.
2. **Short waits.** SkyPilot's controllers wait between looks at a job, a pool or a recovery for
   intervals sized for clouds (15 s between job status checks, 20-30 s between a pool's refreshes,
   60 s before retrying a failed recovery launch). On the one-machine bed every look is answered in
   milliseconds to seconds, and the tests spend most of their time in those waits: ``_WAITS`` makes
   them a few seconds (``GPUDOOR_TESTBED_STOCK_WAITS=1`` keeps SkyPilot's own). What the controllers
   do is unchanged; only how soon they look again. SkyPilot reads these values where it uses them,
   so setting them when their module is imported is enough.

   A look at a job on a cluster is not free: SkyPilot runs a Python program on the node over SSH that
   imports SkyPilot (about 1.5 CPU-s here). The looks that repeat for as long as a job or a warm pool's
   worker lives are spaced so that, with two bed lanes side by side, they leave the 2-core machine room
   for everything else: a job's status check every 10 s (SkyPilot: 15 s); a warm pool's worker keeps
   SkyPilot's own spacing (a readiness probe every 10 s and a job status fetch every 30 s, both a look at
   the worker's setup job), the largest share of the bed's looks when it was shortened: a worker is seen
   ready a few seconds later, and the machine keeps the CPU for the jobs the tests watch.

This module runs at the start of every Python process of the venv, most of them short (SkyPilot starts
one per command it runs, to watch it): it imports nothing beyond ``os`` and ``sys`` until a target
module is imported.
"""

import os
import sys

_ENV = "GPUDOOR_TESTBED_PROBE_URL"
_PROBE_MODULE = "sky.backends.backend_utils"
#: module -> {attribute (``Class.attribute`` for a class's): seconds}
_WAITS = {
    "sky.jobs.utils": {
        "JOB_STATUS_CHECK_GAP_SECONDS": 10,
        "JOB_STARTED_STATUS_CHECK_GAP_SECONDS": 1,
        "_LOG_STREAM_CHECK_CONTROLLER_GAP_SECONDS": 1,
    },
    "sky.jobs.recovery_strategy": {
        "StrategyExecutor.RETRY_INIT_GAP_SECONDS": 5,
        "_LAUNCH_REQUEST_STATUS_POLL_SECONDS": 5,
        "_PARKED_POLL_INITIAL_BACKOFF_SECONDS": 3,
    },
    "sky.serve.replica_managers": {
        "_RETRY_INIT_GAP_SECONDS": 5,
        "_PROCESS_POOL_REFRESH_INTERVAL": 3,
    },
    "sky.serve.constants": {
        "AUTOSCALER_DEFAULT_DECISION_INTERVAL_SECONDS": 3,
        "AUTOSCALER_NO_REPLICA_DECISION_INTERVAL_SECONDS": 2,
    },
}


def _patch(name: str, module) -> None:
    if name == _PROBE_MODULE:
        module._TEST_IP_LIST = [os.environ[_ENV]]
    if os.environ.get("GPUDOOR_TESTBED_STOCK_WAITS") == "1":
        return
    for attribute, seconds in _WAITS.get(name, {}).items():
        owner, _, attr = attribute.rpartition(".")
        target = getattr(module, owner, None) if owner else module
        if target is not None and hasattr(target, attr):
            setattr(target, attr, seconds)


def _targets() -> set:
    return {_PROBE_MODULE, *_WAITS}


class _PatchingLoader:
    """The module's own loader, which patches the module once it has run; the rest is the loader's own."""

    def __init__(self, wrapped, name):
        self._wrapped = wrapped
        self._name = name

    def __getattr__(self, name):  # get_source, get_resource_reader, is_package, ...
        return getattr(self._wrapped, name)

    def create_module(self, spec):
        return self._wrapped.create_module(spec)

    def exec_module(self, module):
        self._wrapped.exec_module(module)
        _patch(self._name, module)


class _Finder:
    def find_spec(self, fullname, path, target=None):
        if fullname not in _targets():
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _PatchingLoader(spec.loader, fullname)
                return spec
        return None


def _install() -> None:
    if not os.environ.get(_ENV):
        return
    for name in _targets():
        already = sys.modules.get(name)
        if already is not None:
            _patch(name, already)
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())


_install()
