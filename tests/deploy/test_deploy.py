"""The deployment files, checked by the ecosystem's own code: dagster, dagster-k8s, the kubernetes
client, dagster-cloud-cli and SkyPilot. No Kubernetes API server and no network: the run pod is the
Job dagster-k8s's own launcher would create, read back through the kubernetes client's models.
"""

from __future__ import annotations

import copy
import json
import re
import sys
from pathlib import Path

import pytest
import yaml

from tests.conftest import PROJECT_ROOT, python_json

DEPLOY = PROJECT_ROOT / "deploy"
HELM_VALUES = DEPLOY / "helm" / "values.yaml"
POOL_LIMITS_JOB = DEPLOY / "helm" / "pool-limits-job.yaml"
INSTANCE_FILE = DEPLOY / "dagster.yaml"
CLOUD_FILE = PROJECT_ROOT / "dagster_cloud.yaml"
SKY_CONFIG = DEPLOY / "skypilot" / "config.yaml"
DEPLOY_README = DEPLOY / "README.md"

#: The release deploy/README.md installs the chart as; it contains the chart's name, so the chart's
#: "fullname" is the release name itself.
RELEASE = "dagster"
NAMESPACE = "dagster"
#: The chart's default `global.dagsterHome`.
CHART_DAGSTER_HOME = "/opt/dagster/dagster_home"
#: The secret keys the run pods read as env (deploy/README.md creates them with these names).
RUN_SECRET_KEYS = {
    "gpudoor-skypilot": {"SKYPILOT_API_SERVER_ENDPOINT", "SKYPILOT_SERVICE_ACCOUNT_TOKEN", "GPUDOOR_LABEL_KEY"},
    "gpudoor-transit": {"GPUDOOR_S3_ACCESS_KEY_ID", "GPUDOOR_S3_SECRET_ACCESS_KEY"},
}


def _load(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


@pytest.fixture(scope="module")
def values() -> dict:
    return _load(HELM_VALUES)


@pytest.fixture(scope="module")
def location() -> dict:
    (loc,) = _load(CLOUD_FILE)["locations"]
    return loc


# --------------------------------------------------------------------------------------------------
# What the chart renders. A transcription of the chart's templates for the sections these values set
# (helpers/instance/_run-launcher.tpl, _run-coordinator.tpl, _concurrency.tpl, _postgresql.tpl and the
# run monitoring / retries blocks of configmap-instance.yaml, in dagster-io/dagster's helm/dagster).
# Postgres is written as `storage: postgres` (the same `postgres_db` block the chart puts under each
# dagster_postgres storage) so dagster core can check it without dagster-postgres installed.
# --------------------------------------------------------------------------------------------------

_RUN_K8S_CONFIG_KEYS = {
    "containerConfig": "container_config",
    "podSpecConfig": "pod_spec_config",
    "podTemplateSpecMetadata": "pod_template_spec_metadata",
    "jobSpecConfig": "job_spec_config",
    "jobMetadata": "job_metadata",
}


def chart_run_launcher(values: dict) -> dict:
    """The `run_launcher` section the chart writes for `runLauncher.type: K8sRunLauncher`."""
    assert values["runLauncher"]["type"] == "K8sRunLauncher"
    k8s = values["runLauncher"]["config"]["k8sRunLauncher"]
    glob = values.get("global") or {}
    config: dict = {
        "load_incluster_config": k8s["loadInclusterConfig"],
        "job_namespace": k8s.get("jobNamespace") or NAMESPACE,
        "image_pull_policy": k8s["imagePullPolicy"],
        "service_account_name": glob.get("serviceAccountName")
        or (values.get("serviceAccount") or {}).get("name")
        or RELEASE,
        "dagster_home": glob.get("dagsterHome") or CHART_DAGSTER_HOME,
        "instance_config_map": f"{RELEASE}-instance",
        "postgres_password_secret": glob.get("postgresqlSecretName") or f"{RELEASE}-postgresql-secret",
    }
    if k8s.get("kubeconfigFile"):
        config["kubeconfig_file"] = k8s["kubeconfigFile"]
    if values.get("imagePullSecrets"):
        config["image_pull_secrets"] = values["imagePullSecrets"]
    if "image" in k8s:
        config["job_image"] = f"{k8s['image']['repository']}:{k8s['image']['tag']}"
    for key, field in (("envConfigMaps", "env_config_maps"), ("envSecrets", "env_secrets")):
        if k8s.get(key):
            config[field] = [ref["name"] for ref in k8s[key] if "name" in ref]
    for key, field in (
        ("envVars", "env_vars"),
        ("volumeMounts", "volume_mounts"),
        ("volumes", "volumes"),
        ("labels", "labels"),
        ("resources", "resources"),
        ("schedulerName", "scheduler_name"),
        ("securityContext", "security_context"),
    ):
        if k8s.get(key):
            config[field] = k8s[key]
    if k8s.get("failPodOnRunFailure"):
        config["fail_pod_on_run_failure"] = True
    if k8s.get("runK8sConfig"):
        config["run_k8s_config"] = {
            snake: k8s["runK8sConfig"][camel]
            for camel, snake in _RUN_K8S_CONFIG_KEYS.items()
            if k8s["runK8sConfig"].get(camel)
        }
    return {"module": "dagster_k8s", "class": "K8sRunLauncher", "config": config}


def chart_instance(values: dict) -> dict:
    """The dagster.yaml the chart writes into the ConfigMap `<release>-instance` (the sections set here)."""
    pg = values["postgresql"]
    instance: dict = {
        "storage": {
            "postgres": {
                "postgres_db": {
                    "username": pg["postgresqlUsername"],
                    "password": {"env": "DAGSTER_PG_PASSWORD"},
                    "hostname": pg["postgresqlHost"] if not pg["enabled"] else f"{RELEASE}-postgresql",
                    "db_name": pg["postgresqlDatabase"],
                    "port": pg["service"]["port"],
                    "params": pg.get("postgresqlParams") or {},
                }
            }
        },
        "run_launcher": chart_run_launcher(values),
        "telemetry": {"enabled": values.get("telemetry", {}).get("enabled", True)},
    }
    logs = values.get("pythonLogs") or {}  # helpers/instance/_python-logs.tpl (when any field is set)
    if logs.get("managedPythonLoggers"):
        instance["python_logs"] = {"managed_python_loggers": logs["managedPythonLoggers"]}
    daemon = values.get("dagsterDaemon") or {}
    daemon_on = daemon.get("enabled", True)  # the chart's default
    coordinator = daemon.get("runCoordinator") or {}
    queued = (coordinator.get("config") or {}).get("queuedRunCoordinator") or {}
    if daemon_on and coordinator.get("enabled") and coordinator.get("type") == "QueuedRunCoordinator":
        instance["run_coordinator"] = {
            "module": "dagster.core.run_coordinator",
            "class": "QueuedRunCoordinator",
        }
        if any(v not in (None, False, 0, "", [], {}) for v in queued.values()):
            # The chart writes -1 when a queue setting is set but not maxConcurrentRuns.
            limit = queued.get("maxConcurrentRuns")
            rc: dict = {"max_concurrent_runs": -1 if limit is None else limit}
            for key, field in (
                ("tagConcurrencyLimits", "tag_concurrency_limits"),
                ("dequeueIntervalSeconds", "dequeue_interval_seconds"),
                ("dequeueUseThreads", "dequeue_use_threads"),
                ("dequeueNumWorkers", "dequeue_num_workers"),
            ):
                if queued.get(key):
                    rc[field] = queued[key]
            instance["run_coordinator"]["config"] = rc
    monitoring = daemon.get("runMonitoring") or {}
    if daemon_on and monitoring.get("enabled"):
        instance["run_monitoring"] = {
            field: monitoring[key]
            for key, field in (
                ("enabled", "enabled"),
                ("startTimeoutSeconds", "start_timeout_seconds"),
                ("cancelTimeoutSeconds", "cancel_timeout_seconds"),
                ("maxResumeRunAttempts", "max_resume_run_attempts"),
                ("pollIntervalSeconds", "poll_interval_seconds"),
                ("freeSlotsAfterRunEndSeconds", "free_slots_after_run_end_seconds"),
            )
            if monitoring.get(key) is not None
        }
    retries = daemon.get("runRetries") or {}
    if daemon_on and retries.get("enabled"):
        instance["run_retries"] = {"enabled": True}
        if retries.get("maxRetries"):
            instance["run_retries"]["max_retries"] = retries["maxRetries"]
        if retries.get("retryOnAssetOrOpFailure") is not None:
            instance["run_retries"]["retry_on_asset_or_op_failure"] = retries["retryOnAssetOrOpFailure"]
    concurrency = values.get("concurrency") or {}
    if concurrency.get("enabled"):
        runs, pools = concurrency.get("runs") or {}, concurrency.get("pools") or {}
        if queued.get("maxConcurrentRuns") is not None and runs.get("maxConcurrentRuns") is not None:
            raise ValueError("the chart fails: maxConcurrentRuns set in both concurrency.runs and the run coordinator")
        rendered: dict = {}
        pool_fields = {
            "defaultLimit": "default_limit",
            "granularity": "granularity",
            "opGranularityRunBuffer": "op_granularity_run_buffer",
        }
        if any(pools.get(k) is not None for k in pool_fields):
            rendered["pools"] = {f: pools[k] for k, f in pool_fields.items() if pools.get(k) is not None}
        if runs.get("maxConcurrentRuns") is not None or runs.get("tagConcurrencyLimits"):
            rendered["runs"] = {}
            if runs.get("maxConcurrentRuns") is not None:
                rendered["runs"]["max_concurrent_runs"] = runs["maxConcurrentRuns"]
            if runs.get("tagConcurrencyLimits"):
                rendered["runs"]["tag_concurrency_limits"] = runs["tagConcurrencyLimits"]
        instance["concurrency"] = rendered
    return instance


def load_instance_config(tmp_path: Path, instance: dict) -> dict:
    """Loads a dagster.yaml through Dagster's own loader (schema and cross-section checks)."""
    from dagster._core.instance.config import dagster_instance_config

    (tmp_path / "dagster.yaml").write_text(yaml.safe_dump(instance))
    config, _ = dagster_instance_config(str(tmp_path))
    return config


def process_launcher_config(config: dict) -> dict:
    """The run launcher's config, processed by K8sRunLauncher's own schema (defaults filled in)."""
    from dagster._config import process_config
    from dagster_k8s import K8sRunLauncher

    result = process_config(K8sRunLauncher.config_type(), config)
    assert result.success, [e.message for e in result.errors]
    return dict(result.value)


# --------------------------------------------------------------------------------------------------
# The instance: Helm values and deploy/dagster.yaml
# --------------------------------------------------------------------------------------------------


def test_helm_values_render_an_instance_dagster_accepts(values, tmp_path):
    """What the chart writes from the values loads as a Dagster instance, its run launcher as dagster-k8s's."""
    rendered = chart_instance(values)
    config = load_instance_config(tmp_path, rendered)
    launcher = process_launcher_config(config["run_launcher"]["config"])
    assert launcher["job_namespace"] == NAMESPACE
    assert launcher["env_secrets"] == sorted(RUN_SECRET_KEYS)
    assert config["concurrency"]["pools"] == {"default_limit": 4, "granularity": "op"}
    assert config["run_monitoring"]["max_resume_run_attempts"] == 3
    # A run shows when it waits out an outage of the bucket or the API server, and when it is over.
    assert config["python_logs"]["managed_python_loggers"] == ["gpudoor_pipelines.outage"]
    assert config["run_retries"] == {"enabled": True, "max_retries": 2, "retry_on_asset_or_op_failure": False}
    # Queued, with no limit under the coordinator: the limits are in `concurrency.runs`.
    assert "config" not in config["run_coordinator"] and config["concurrency"]["runs"]["max_concurrent_runs"] == 40


def test_instance_file_holds_what_the_chart_renders(values, tmp_path):
    """deploy/dagster.yaml (for an install without the chart) has the same settings as the Helm values."""
    config = load_instance_config(tmp_path, _load(INSTANCE_FILE))
    chart = chart_instance(values)
    assert process_launcher_config(config["run_launcher"]["config"]) == process_launcher_config(
        chart["run_launcher"]["config"]
    )
    assert config["run_launcher"]["module"] == "dagster_k8s" and config["run_launcher"]["class"] == "K8sRunLauncher"
    for section in ("concurrency", "run_monitoring", "run_retries", "telemetry", "python_logs"):
        assert config[section] == chart[section], section
    expected_pg = dict(chart["storage"]["postgres"]["postgres_db"])
    assert {k: v for k, v in config["storage"]["postgres"]["postgres_db"].items() if k in expected_pg} == expected_pg


def test_instance_settings_take_effect_in_a_real_instance(values, tmp_path):
    """deploy/dagster.yaml in a real Dagster instance: its K8sRunLauncher (which can resume a run, as run
    monitoring requires), queue, monitoring, retries and pools. Local storage instead of Postgres."""
    import dagster as dg
    from dagster_k8s import K8sRunLauncher

    from gpudoor_pipelines.assets.concurrency import sync_pool_limits

    settings = {k: v for k, v in _load(INSTANCE_FILE).items() if k != "storage"}
    # No cluster here: a kubeconfig instead of the in-cluster config.
    settings["run_launcher"]["config"].update(
        load_incluster_config=False, kubeconfig_file=str(_fake_kubeconfig(tmp_path))
    )
    home = tmp_path / "home"
    home.mkdir()
    (home / "dagster.yaml").write_text(yaml.safe_dump(settings))
    with dg.DagsterInstance.from_config(str(home)) as instance:
        assert isinstance(instance.run_launcher, K8sRunLauncher) and instance.run_launcher.supports_resume_run
        assert instance.run_monitoring_enabled and instance.run_monitoring_max_resume_run_attempts == 3
        assert instance.run_retries_enabled and instance.run_retries_max_retries == 2
        assert instance.run_retries_retry_on_asset_or_op_failure is False
        concurrency = instance.get_concurrency_config()
        assert concurrency.pool_config.default_pool_limit == 4
        assert concurrency.run_queue_config.max_concurrent_runs == 40
        assert concurrency.run_queue_config.max_user_code_failure_retries == 3
        # The pools' limits as the Job writes them, read back from the instance.
        sync_pool_limits(instance, values["gpudoor"]["poolLimits"])
        for pool, limit in values["gpudoor"]["poolLimits"].items():
            assert instance.event_log_storage.get_concurrency_info(pool).slot_count == limit


def _misspelled_launcher_key(instance: dict) -> None:
    instance["run_launcher"]["config"]["job_namspace"] = instance["run_launcher"]["config"].pop("job_namespace")


def _misspelled_section(instance: dict) -> None:
    instance["run_monitorng"] = instance.pop("run_monitoring")


def _queue_limit_in_two_places(instance: dict) -> None:
    instance["run_queue"]["max_concurrent_runs"] = 10


def _negative_pool_default(instance: dict) -> None:
    instance["concurrency"]["pools"]["default_limit"] = -1


@pytest.mark.parametrize(
    ("break_it", "message"),
    [
        (_misspelled_launcher_key, 'unexpected config entry "job_namspace"'),
        (_misspelled_section, 'unexpected config entry "run_monitorng"'),
        (_queue_limit_in_two_places, "incompatible with the `concurrency > runs` config"),
        (_negative_pool_default, "default_limit"),
    ],
)
def test_a_broken_instance_file_is_refused(break_it, message, tmp_path):
    """Each mistake is refused, by Dagster's instance loader or by the run launcher's own schema."""
    from dagster._core.errors import DagsterInvalidConfigError

    instance = _load(INSTANCE_FILE)
    break_it(instance)
    with pytest.raises((DagsterInvalidConfigError, AssertionError), match=re.escape(message)):
        config = load_instance_config(tmp_path, instance)
        process_launcher_config(config["run_launcher"]["config"])


def test_a_queue_setting_under_the_coordinator_breaks_the_helm_instance(values, tmp_path):
    """Why `queuedRunCoordinator` stays empty in the values: anything there conflicts with `concurrency`."""
    from dagster._core.errors import DagsterInvalidConfigError

    broken = copy.deepcopy(values)
    broken["dagsterDaemon"]["runCoordinator"]["config"]["queuedRunCoordinator"] = {"dequeueUseThreads": True}
    with pytest.raises(DagsterInvalidConfigError, match="max_concurrent_runs"):
        load_instance_config(tmp_path, chart_instance(broken))


# --------------------------------------------------------------------------------------------------
# The run pod, built by dagster-k8s
# --------------------------------------------------------------------------------------------------


class _CapturingBatchApi:
    """The part of kubernetes' BatchV1Api the launcher calls to create a Job; keeps what it gets."""

    def __init__(self):
        self.created: list = []

    def create_namespaced_job(self, body, namespace, **_):
        self.created.append((namespace, body))
        return body


def _fake_kubeconfig(tmp_path: Path) -> Path:
    path = tmp_path / "kubeconfig"
    path.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "c", "cluster": {"server": "https://127.0.0.1:9"}}],
                "users": [{"name": "u", "user": {"token": "t"}}],
                "contexts": [{"name": "x", "context": {"cluster": "c", "user": "u"}}],
                "current-context": "x",
            }
        )
    )
    return path


def _launch_run_pod(values: dict, location: dict, tmp_path: Path):
    """The (namespace, V1Job) K8sRunLauncher creates for one run of the Dagster+ code location.

    The launcher is configured from the Helm values as the chart renders them; the run carries the
    code location's image and container context, as runs launched from that location do.
    """
    import dagster as dg
    from dagster._core.code_pointer import ModuleCodePointer
    from dagster._core.launcher import LaunchRunContext
    from dagster._core.origin import JobPythonOrigin, RepositoryPythonOrigin
    from dagster._core.storage.dagster_run import DagsterRun
    from dagster_k8s import K8sRunLauncher

    config = process_launcher_config(chart_run_launcher(values)["config"])
    # No cluster here: read a kubeconfig instead of the in-cluster one, and capture the Job.
    config.update(load_incluster_config=False, kubeconfig_file=str(_fake_kubeconfig(tmp_path)))
    batch_api = _CapturingBatchApi()
    launcher = K8sRunLauncher(**config, k8s_client_batch_api=batch_api)
    module = location["code_source"]["module_name"]
    origin = JobPythonOrigin(
        "__ASSET_JOB",
        RepositoryPythonOrigin(
            executable_path=sys.executable,
            code_pointer=ModuleCodePointer(module, "defs", working_directory=None),
            container_image=location["image"],
            container_context=location["container_context"],
        ),
    )
    with dg.instance_for_test() as instance:
        launcher.register_instance(instance)
        run = instance.add_run(
            DagsterRun(job_name="__ASSET_JOB", run_id="6a0e4a0e-0000-4000-8000-000000000001", job_code_origin=origin)
        )
        launcher.launch_run(LaunchRunContext(dagster_run=run, workspace=None))
    ((namespace, job),) = batch_api.created
    return namespace, job


def _roundtrip(model, type_name: str):
    """Serializes a kubernetes model as the API would receive it and reads it back with the client's models."""
    from kubernetes.client import ApiClient

    client = ApiClient()
    body = client.sanitize_for_serialization(model)

    class _Response:
        data = json.dumps(body)

    return body, client.deserialize(_Response(), type_name)


def test_run_pod_built_by_dagster_k8s(values, location, tmp_path):
    """The Job a run gets: the location's image, service account and secrets, the run size, the instance."""
    from kubernetes.client import V1Job

    namespace, job = _launch_run_pod(values, location, tmp_path)
    body, job = _roundtrip(job, "V1Job")
    assert isinstance(job, V1Job) and body["kind"] == "Job"
    k8s = location["container_context"]["k8s"]
    assert namespace == k8s["namespace"]
    pod = job.spec.template.spec
    (container,) = pod.containers
    assert container.image == location["image"]
    assert container.image_pull_policy == "IfNotPresent"
    # The code location's service account wins over the chart's.
    assert pod.service_account_name == k8s["service_account_name"] == "gpudoor-runs"
    assert [s.secret_ref.name for s in container.env_from if s.secret_ref] == sorted(RUN_SECRET_KEYS)
    env = {e.name: e for e in container.env}
    for literal in k8s["env_vars"]:
        name, value = literal.split("=", 1)
        assert env[name].value == value
    assert env["DAGSTER_HOME"].value == CHART_DAGSTER_HOME
    pg = env["DAGSTER_PG_PASSWORD"].value_from.secret_key_ref
    assert (pg.name, pg.key) == ("dagster-postgresql-secret", "postgresql-password")
    assert container.resources.requests == {"cpu": "500m", "memory": "1Gi"}
    assert container.resources.limits == {"cpu": "2", "memory": "4Gi"}
    # The run worker gets the instance in its arguments (the Postgres password from the env above).
    assert container.args[1:5] == ["-m", "dagster", "api", "execute_run"]
    assert pod.restart_policy == "Never" and job.spec.backoff_limit == 0
    labels = job.spec.template.metadata.labels
    assert labels["app.kubernetes.io/part-of"] == "gpudoor-pipelines"
    assert labels["dagster/run-id"] == "6a0e4a0e-0000-4000-8000-000000000001"
    assert job.spec.template.metadata.annotations["cluster-autoscaler.kubernetes.io/safe-to-evict"] == "false"


def test_run_pod_env_is_what_the_package_reads():
    """Every variable the pods get (literal or from the secrets) is one the package reads."""
    sources = "".join(
        (PROJECT_ROOT / "gpudoor_pipelines" / p).read_text() for p in ("settings.py", "transit/resource.py")
    )
    loc = _load(CLOUD_FILE)["locations"][0]["container_context"]["k8s"]
    names = {v.split("=", 1)[0] for v in loc["env_vars"]} | set().union(*RUN_SECRET_KEYS.values())
    for name in sorted(names):
        assert re.search(rf"\b{name}\b", sources), f"{name} is read nowhere in the package"


@pytest.mark.parametrize(
    ("asset_name", "cpu", "memory"),
    [("dataset_shards", "1", "4Gi"), ("captioned_dataset", "1", "2Gi"), ("gpu_usage", "1", "2Gi")],
)
def test_cpu_step_pod_is_sized_by_its_op_tags(asset_name, cpu, memory, location):
    """A CPU step's own pod (k8s_job_executor): the location's context, sized by the asset's op tags."""
    from dagster_k8s.container_context import K8sContainerContext
    from dagster_k8s.job import DagsterK8sJobConfig, construct_dagster_k8s_job, get_user_defined_k8s_config

    from gpudoor_pipelines.assets import captioning, usage

    asset = getattr(captioning, asset_name, None) or getattr(usage, asset_name)
    step = K8sContainerContext(run_k8s_config=get_user_defined_k8s_config(asset.op.tags))
    context = K8sContainerContext.create_from_config(location["container_context"]).merge(step)
    job_config = DagsterK8sJobConfig(job_image=location["image"], dagster_home=CHART_DAGSTER_HOME)
    job = construct_dagster_k8s_job(
        job_config,
        args=["dagster", "api", "execute_step"],
        job_name=f"dagster-step-{asset_name.replace('_', '-')}",
        user_defined_k8s_config=context.run_k8s_config,
        component="step_worker",
    )
    _, job = _roundtrip(job, "V1Job")
    (container,) = job.spec.template.spec.containers
    assert container.resources.requests == {"cpu": cpu, "memory": memory}
    assert container.resources.limits == {"cpu": cpu, "memory": memory}
    assert [s.secret_ref.name for s in container.env_from] == sorted(RUN_SECRET_KEYS)
    assert job.spec.template.spec.service_account_name == "gpudoor-runs"


# --------------------------------------------------------------------------------------------------
# dagster_cloud.yaml
# --------------------------------------------------------------------------------------------------


def test_dagster_cloud_yaml_parsed_by_dagster_cloud_cli(location):
    """dagster-cloud-cli's own models read the file (skipped until it is installed)."""
    models = pytest.importorskip("dagster_cloud_cli.config.models")
    from dagster_cloud_cli.config.merger import DagsterCloudConfigDefaultsMerger

    processed = DagsterCloudConfigDefaultsMerger().process(models.load_dagster_cloud_yaml(CLOUD_FILE.read_text()))
    (loc,) = processed.locations
    assert loc.location_name == "gpudoor_pipelines"
    assert loc.code_source.module_name == "gpudoor_pipelines.definitions"
    assert loc.image == location["image"]
    assert loc.container_context == location["container_context"]


def test_dagster_cloud_cli_refuses_a_misspelled_field():
    models = pytest.importorskip("dagster_cloud_cli.config.models")
    from pydantic import ValidationError

    broken = _load(CLOUD_FILE)
    broken["locations"][0]["container_contxt"] = broken["locations"][0].pop("container_context")
    with pytest.raises(ValidationError, match="container_contxt"):
        models.load_dagster_cloud_yaml(yaml.safe_dump(broken))


def test_container_context_read_by_dagster_k8s(location):
    """The location's `container_context.k8s` parses with dagster-k8s; a misspelled key is refused."""
    import importlib.util

    from dagster._core.errors import DagsterInvalidConfigError
    from dagster_k8s.container_context import K8sContainerContext

    assert importlib.util.find_spec(location["code_source"]["module_name"]) is not None
    context = K8sContainerContext.create_from_config(location["container_context"])
    assert context.namespace == "dagster"
    assert context.server_k8s_config.container_config["resources"]["limits"]["memory"] == "2Gi"
    broken = copy.deepcopy(location["container_context"])
    broken["k8s"]["env_secret"] = broken["k8s"].pop("env_secrets")
    with pytest.raises(DagsterInvalidConfigError):
        K8sContainerContext.create_from_config(broken)


# --------------------------------------------------------------------------------------------------
# The GPU pools' limits and the secrets
# --------------------------------------------------------------------------------------------------


def test_pool_limits_match_the_fleet(values, location):
    """The values' pool limits and the Job that writes them are what `gpudoor pools` computes from the fleet."""
    from dagster_k8s.models import k8s_model_from_dict, k8s_snake_case_dict
    from kubernetes.client import V1Job

    from gpudoor_pipelines.assets.concurrency import pool_limits

    limits = pool_limits()
    assert values["gpudoor"]["poolLimits"] == limits
    manifest = _load(POOL_LIMITS_JOB)
    job = k8s_model_from_dict(V1Job, k8s_snake_case_dict(V1Job, manifest))
    (container,) = job.spec.template.spec.containers
    written = dict(re.findall(r"dagster instance concurrency set (\S+) (\d+)", "\n".join(container.args)))
    assert {k: int(v) for k, v in written.items()} == limits
    # The instance and the password the chart made, from the code location's image.
    launcher = chart_run_launcher(values)["config"]
    assert [v.config_map.name for v in job.spec.template.spec.volumes] == [launcher["instance_config_map"]]
    env = {e.name: e for e in container.env}
    assert env["DAGSTER_PG_PASSWORD"].value_from.secret_key_ref.name == launcher["postgres_password_secret"]
    assert env["DAGSTER_HOME"].value == launcher["dagster_home"]
    (mount,) = container.volume_mounts
    assert (mount.mount_path, mount.sub_path) == (f"{launcher['dagster_home']}/dagster.yaml", "dagster.yaml")
    assert manifest["metadata"]["namespace"] == launcher["job_namespace"]
    (deployment,) = values["dagster-user-deployments"]["deployments"]
    image = f"{deployment['image']['repository']}:{deployment['image']['tag']}"
    assert container.image == image == location["image"]


def _readme_secrets() -> dict[str, set[str]]:
    """`kubectl create secret generic NAME --from-literal=KEY=...` in deploy/README.md: name → keys."""
    text = DEPLOY_README.read_text().replace("\\\n", " ")
    secrets = {}
    for line in text.splitlines():
        m = re.search(r"create secret generic (\S+)(.*)", line)
        if m:
            secrets[m.group(1)] = set(re.findall(r"--from-(?:literal|file)=([A-Za-z0-9_.-]+)=", m.group(2)))
    return secrets


def test_readme_creates_the_secrets_the_files_name(values, location):
    """The secrets deploy/README.md creates are the ones the files use, with the keys the code reads."""
    from gpudoor_pipelines.launch.resolve.fleet import load_fleet
    from gpudoor_pipelines.launch.server.policy import LABEL_KEY_NAME, SECRET_ENV_VARS, TRANSIT_ENV_VARS

    secrets = _readme_secrets()
    for name, keys in RUN_SECRET_KEYS.items():
        assert secrets[name] == keys
    assert secrets[chart_run_launcher(values)["config"]["postgres_password_secret"]] == {"postgresql-password"}
    assert set(location["container_context"]["k8s"]["env_secrets"]) <= set(secrets)
    # The API server's: what the policy reads as GPUDOOR_POLICY_<NAME>, and the database (the SkyPilot
    # chart's `dbConnectionSecretName` reads the key `connection_string`).
    readable = {
        f"GPUDOOR_POLICY_{n}" for n in (*SECRET_ENV_VARS, *TRANSIT_ENV_VARS, *load_fleet().secrets, LABEL_KEY_NAME)
    }
    assert secrets["gpudoor-policy"] <= readable
    assert {"GPUDOOR_POLICY_AWS_ACCESS_KEY_ID", "GPUDOOR_POLICY_AWS_SECRET_ACCESS_KEY"} <= secrets["gpudoor-policy"]
    assert secrets["skypilot-db"] == {"connection_string"}
    # Run identities on jobs are signed in the code location and checked on the server: one key, both sides.
    assert (
        "GPUDOOR_LABEL_KEY" in secrets["gpudoor-skypilot"] and "GPUDOOR_POLICY_LABEL_KEY" in secrets["gpudoor-policy"]
    )


# --------------------------------------------------------------------------------------------------
# The SkyPilot API server
# --------------------------------------------------------------------------------------------------


@pytest.fixture
def strict_sky_schema(monkeypatch):
    """SkyPilot's config schema as the API server applies it: strict, unknown keys refused."""
    from gpudoor_pipelines.launch import sky_env

    sky_env.prepare()
    from sky.server import plugins
    from sky.skylet import constants
    from sky.utils import common_utils, schemas

    monkeypatch.setenv(constants.ENV_VAR_IS_SKYPILOT_SERVER, "1")
    monkeypatch.setattr(plugins, "_plugins_loaded", True)

    def validate(config: dict) -> None:
        # What the server runs on a config before saving it (sky/workspaces/core.py: update_config).
        common_utils.validate_schema(config, schemas.get_config_schema(), "Invalid SkyPilot configuration: ")

    return validate


def test_skypilot_config_passes_skypilots_schema(strict_sky_schema):
    strict_sky_schema(_load(SKY_CONFIG))


@pytest.mark.parametrize(
    ("path", "bad"),
    [
        (("admin_polcy",), "gpudoor_pipelines.launch.policy.GpuDoorPolicy"),
        (("allowed_clouds",), ["slrum"]),
        (("slurm", "cluster_configs", "onprem", "wrokdir"), "/mnt/scratch"),
        (("kubernetes", "context_configs", "inference-prod", "namespce"), "research"),
        (("jobs", "controller", "consolidation"), True),
    ],
)
def test_a_broken_skypilot_config_is_refused(strict_sky_schema, path, bad):
    from sky import exceptions

    config = _load(SKY_CONFIG)
    node = config
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = bad
    with pytest.raises(exceptions.InvalidSkyPilotConfigError):
        strict_sky_schema(config)


def test_skypilot_config_matches_the_fleet():
    """The server allows exactly the fleet's Slurm clusters and Kubernetes context, at its priority class."""
    from gpudoor_pipelines.launch.resolve.fleet import load_fleet

    config = _load(SKY_CONFIG)
    pools = load_fleet().pools.values()
    infra = [p.infra.split("/") for p in pools]
    assert set(config["slurm"]["allowed_clusters"]) == {i[1] for i in infra if i[0] == "slurm"}
    assert set(config["slurm"]["cluster_configs"]) == set(config["slurm"]["allowed_clusters"])
    assert set(config["kubernetes"]["allowed_contexts"]) == {i[1] for i in infra if i[0] == "k8s"}
    clouds = {"k8s": "kubernetes"}
    assert {clouds.get(i[0], i[0]) for i in infra} == set(config["allowed_clouds"])
    for pool in pools:
        if pool.infra.startswith("k8s/"):
            ctx = config["kubernetes"]["context_configs"][pool.infra.split("/")[1]]
            assert ctx["pod_config"]["spec"]["priorityClassName"] == pool.priority_class
            assert ctx["namespace"]


def test_api_server_loads_the_policy_without_dagster():
    """The policy loads the way the server loads it, with only what SkyPilot's image has (the Dockerfile's "
    "--no-deps)."""
    result = python_json(
        """
        import importlib.abc, json, sys
        BLOCKED = ("dagster", "dagster_k8s", "torch", "pandas", "pyarrow", "boto3", "PIL", "upath")

        class Block(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in BLOCKED:
                    raise ImportError(f"{name} is not in the API server's image")

        sys.meta_path.insert(0, Block())
        import yaml
        from sky.utils import admin_policy_utils
        config = yaml.safe_load(open("deploy/skypilot/config.yaml"))
        policy = admin_policy_utils._get_policy_impl(config["admin_policy"])
        from gpudoor_pipelines.launch.resolve.fleet import load_fleet
        import os
        fleet = load_fleet(os.environ["GPUDOOR_FLEET_FILE"])
        loaded = type(policy).__module__ + "." + type(policy).__name__
        # The server's plugins file, loaded by SkyPilot's own loader as a request executor loads it.
        from sky.jobs import runner
        from sky.server import plugins
        plugins.load_plugins(plugins.ExtensionContext(context=plugins.PluginContext.EXECUTOR))
        jobs_runner = type(runner.current()).__module__ + "." + type(runner.current()).__name__
        print(json.dumps({"policy": loaded, "pools": sorted(fleet.pools), "jobs_runner": jobs_runner}))
        """,
        {
            "GPUDOOR_FLEET_FILE": str(PROJECT_ROOT / "task_specs" / "fleet.yaml"),
            "SKYPILOT_SERVER_PLUGINS_CONFIG": str(PROJECT_ROOT / "deploy" / "skypilot" / "plugins.yaml"),
        },
    )
    assert result["policy"] == _load(SKY_CONFIG)["admin_policy"]
    assert result["pools"] == ["h200", "inference", "ondemand", "onprem"]
    # The server's plugin loads without them too: the jobs table is read in the request's process.
    assert result["jobs_runner"] == "gpudoor_pipelines.launch.server.plugin.InProcessJobTable"


def test_with_postgres_skypilot_keeps_its_config_in_the_database(tmp_path):
    """Why deploy/README.md loads the config through the dashboard: with a database URI, SkyPilot 0.14.1
    refuses a server config file that holds more than the database."""
    result = python_json(
        """
        import json
        try:
            # The server reads its config as soon as SkyPilot is imported.
            from sky import skypilot_config
            skypilot_config._reload_config_as_server()
            print(json.dumps({"error": None}))
        except ValueError as e:
            print(json.dumps({"error": str(e)}))
        """,
        {
            "SKYPILOT_GLOBAL_CONFIG": str(SKY_CONFIG),
            "SKYPILOT_DB_CONNECTION_URI": "postgresql://skypilot:x@127.0.0.1:9/skypilot",
            "IS_SKYPILOT_SERVER": "1",
            "HOME": str(tmp_path),
        },
    )
    assert result["error"] == "If db config is specified, no other config is allowed"
