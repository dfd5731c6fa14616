"""A SkyPilot API server plugin: the managed-jobs and warm-pool tables read in the request's own process.

With the jobs controller in consolidation mode (it runs inside the API server, deploy/skypilot/config.yaml),
the managed-jobs and pool tables are the server's own database. SkyPilot still answers every
``sky.jobs.queue`` and ``sky.jobs.pool_status`` by starting a Python process that imports SkyPilot to read
them: about 2 CPU-seconds a look (``benchmarks/server_request_cost.py``), on the server that also runs every
job's controller. The door looks at its jobs and pools often (each step's wait, the reconciler,
``gpudoor status``, coding agents that launch many jobs), so on a busy server those processes are a large
share of its CPU. This plugin registers runners (SkyPilot's ``sky.jobs.runner`` and ``sky.serve.runner``,
made for this) that answer the same reads in the executor serving the request: the same SkyPilot function
the process would call, the same answer, 0.14 CPU-seconds. Cancels and log streams keep SkyPilot's own
path, and where the controller runs apart (its tables on its own machine) nothing changes.

Enable it in the server's plugins file (``~/.sky/plugins.yaml``, or the file named by
``SKYPILOT_SERVER_PLUGINS_CONFIG``; deploy/skypilot/plugins.yaml)::

    plugins:
      - class: gpudoor_pipelines.launch.server.plugin.JobTablePlugin

Like the policy, this module imports ``sky`` at import time: only the API server imports it.
"""

from __future__ import annotations

from typing import Any

from gpudoor_pipelines.launch import sky_env

sky_env.prepare()
from sky.jobs import runner as managed_job_runner  # noqa: E402
from sky.serve import runner as pool_status_runner  # noqa: E402
from sky.server import plugins  # noqa: E402


class _Wrapping:
    """A SkyPilot runner in front of the one it replaces: what it does not do itself goes to that one."""

    def __init__(self, fallback: Any) -> None:
        self._fallback = fallback

    def __getattr__(self, name: str) -> Any:
        return getattr(self._fallback, name)


class InProcessJobTable(_Wrapping):
    """SkyPilot's managed-jobs runner, with the table read in this process where the controller is.

    Everything but the table (cancels, log streams, events) goes to the runner it replaces.
    """

    def fetch_managed_job_table(self, *, handle: Any, backend: Any, **query: Any) -> tuple:
        from sky.jobs import utils as managed_job_utils

        if not managed_job_utils.is_consolidation_mode():
            return self._fallback.fetch_managed_job_table(handle=handle, backend=backend, **query)
        # Through the payload the controller's process prints, so that the answer is the one it gives,
        # with its encoding (statuses, user names) and nothing of this process's own objects.
        return managed_job_utils.load_managed_job_queue(managed_job_utils.dump_managed_job_queue(**query))


class InProcessPoolStatus(_Wrapping):
    """SkyPilot's pool and service status runner, with the table read in this process where the controller is."""

    def get_service_status(self, *, handle: Any, service_names: list[str] | None, pool: bool) -> list[dict[str, Any]]:
        from sky.serve import serve_utils

        if not serve_utils.is_consolidation_mode(pool):
            return self._fallback.get_service_status(handle=handle, service_names=service_names, pool=pool)
        # Through the payload the controller's process prints, as for the jobs table.
        return serve_utils.load_service_status(serve_utils.get_service_status_encoded(service_names, pool=pool))


class JobTablePlugin(plugins.BasePlugin):
    """Installs :class:`InProcessJobTable` and :class:`InProcessPoolStatus` in the API server's request executors."""

    load_contexts = frozenset({plugins.PluginContext.EXECUTOR})

    @property
    def name(self) -> str:
        return "gpudoor job table"

    def install(self, extension_context: plugins.ExtensionContext) -> None:
        del extension_context
        for registry, runner in ((managed_job_runner, InProcessJobTable), (pool_status_runner, InProcessPoolStatus)):
            current = registry.current()
            if not isinstance(current, runner):
                registry.register(runner(current))
