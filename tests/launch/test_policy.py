"""The admin policy, applied through SkyPilot's own machinery to the real task specs.

Every rule has an accepting and a rejecting case; the mutated task still validates with SkyPilot.
"""

from __future__ import annotations

import copy
import types

import pytest
import yaml

from tests.conftest import SPECS_DIR, given_inputs

POLICY = "gpudoor_pipelines.launch.server.policy.GpuDoorPolicy"


@pytest.fixture(scope="module")
def sky():
    import sky

    return sky


def _apply(sky, config: dict, request="jobs.launch", cluster_name=None, at_client_side=True):
    """Applies the configured admin policy exactly as SkyPilot does, on the client (default) or the server."""
    from sky import admin_policy, skypilot_config
    from sky.server.requests.request_names import AdminPolicyRequestName
    from sky.utils import admin_policy_utils

    task = sky.Task.from_yaml_config(copy.deepcopy(config))
    options = None
    if cluster_name:
        options = admin_policy.RequestOptions(
            cluster_name=cluster_name, idle_minutes_to_autostop=None, down=False, dryrun=False
        )
    with skypilot_config.override_skypilot_config({"admin_policy": POLICY}):
        dag, _ = admin_policy_utils.apply(task, AdminPolicyRequestName(request), options, at_client_side=at_client_side)
    return dag.tasks[0]


def _spec(name: str, **resources) -> dict:
    """A shipped spec as SkyPilot gets it: its required inputs (``NAME: null``) given, as ``--env`` gives them."""
    config = yaml.safe_load((SPECS_DIR / f"{name}.yaml").read_text())
    config["resources"] = {**config["resources"], **resources}
    config["envs"] = {k: f"{k.lower()}-given" if v is None else v for k, v in (config.get("envs") or {}).items()}
    return config


OWNER = {"gpudoor-cost-owner": "ml-research"}


@pytest.fixture(autouse=True)
def _server_counts(monkeypatch):
    """The shipped fleet has the API server count what is held (``live_caps: server``), as deploy/ runs it: its
    jobs tables are faked, holding nothing (no jobs controller runs here)."""
    _held(monkeypatch)


def _resources(task):
    (r,) = task.resources
    return r


def test_accepts_and_injects_pool_env_labels_and_priority_on_production(sky):
    task = _apply(sky, _spec("eval", infra="k8s/inference-prod", labels=OWNER))
    r = _resources(task)
    assert task.envs["CHECKPOINTS_DIR"] == "/scratch/checkpoints" and task.envs["GPUDOOR_POOL"] == "inference"
    assert r.labels["gpudoor-cost-owner"] == "ml-research" and r.labels["gpudoor-pool"] == "inference"
    assert r.accelerators == {"L4": 1}
    assert r.cluster_config_overrides["kubernetes"]["pod_config"]["spec"]["priorityClassName"] == "research-preemptible"
    # Still a valid SkyPilot task, and applying the policy twice (client then server) changes nothing.
    again = _apply(sky, task.to_yaml_config())
    assert again.envs == task.envs and _resources(again).labels == r.labels


def test_routes_when_no_infra_is_given(sky):
    task = _apply(sky, _spec("train", labels={**OWNER, "gpudoor-step": "train"}))
    assert str(_resources(task).infra.to_str()).startswith("slurm/h200-ib")
    assert task.envs["CHECKPOINTS_DIR"] == "/lustre/checkpoints"


def test_slurm_pool_gets_no_kubernetes_priority(sky):
    task = _apply(sky, _spec("caption", infra="slurm/onprem", labels=OWNER))
    assert not (_resources(task).cluster_config_overrides or {}).get("kubernetes")


def test_transit_credentials_become_secrets_not_envs(sky, monkeypatch):
    monkeypatch.setenv("GPUDOOR_POLICY_AWS_ACCESS_KEY_ID", "AKIA-test-id")
    monkeypatch.setenv("GPUDOOR_POLICY_AWS_SECRET_ACCESS_KEY", "very-secret-value")
    monkeypatch.setenv("GPUDOOR_POLICY_AWS_ENDPOINT_URL", "http://127.0.0.1:9000")
    task = _apply(sky, _spec("caption", infra="slurm/onprem", labels=OWNER), at_client_side=False)
    assert "AWS_SECRET_ACCESS_KEY" not in task.envs
    assert task.secrets["AWS_SECRET_ACCESS_KEY"].get_secret_value() == "very-secret-value"
    assert task.envs["AWS_ENDPOINT_URL"] == "http://127.0.0.1:9000"
    assert "very-secret-value" not in yaml.safe_dump(task.to_yaml_config(use_user_specified_yaml=True))


def test_autostop_for_lab_clusters_only(sky):
    demo = _apply(
        sky, _spec("demo", infra="k8s/inference-prod", labels=OWNER), request="launch", cluster_name="lab-demo"
    )
    assert _resources(demo).autostop_config is not None and _resources(demo).autostop_config.enabled
    job = _apply(sky, _spec("eval", infra="k8s/inference-prod", labels=OWNER))
    assert _resources(job).autostop_config is None or not _resources(job).autostop_config.enabled


def _rejected(sky, config, match, **kw):
    with pytest.raises(sky.exceptions.UserRequestRejectedByPolicy, match=match) as err:
        _apply(sky, config, **kw)
    assert "Fix:" in str(err.value)
    return err


def test_a_task_naming_no_cost_owner_is_billed_to_the_fleet_default(sky):
    """As the launcher and `gpudoor where` do: the same task gets the same cost owner everywhere."""
    task = _apply(sky, _spec("eval", infra="k8s/inference-prod"))
    assert _resources(task).labels["gpudoor-cost-owner"] == "ml-research"


def test_a_task_keeps_its_own_cost_owner(sky):
    task = _apply(sky, _spec("eval", infra="k8s/inference-prod", labels={"gpudoor-cost-owner": "ml-engineering"}))
    assert _resources(task).labels["gpudoor-cost-owner"] == "ml-engineering"


def test_rejects_unknown_cost_owner(sky):
    _rejected(
        sky,
        _spec("eval", infra="k8s/inference-prod", labels={"gpudoor-cost-owner": "marketing"}),
        "unknown cost owner 'marketing'",
    )


def test_rejects_gpu_the_pool_does_not_have(sky):
    _rejected(sky, _spec("train", infra="k8s/inference-prod", labels=OWNER), "has no H200")


def test_rejects_request_over_the_pool_cap(sky):
    config = _spec("train", infra="slurm/h200-ib", labels=OWNER)
    config["num_nodes"] = 17  # 17 x 8 H200 > 128
    _rejected(sky, config, "over pool 'h200' cap of 128")


def test_accepts_request_at_the_cap_boundary(sky):
    config = _spec("train", infra="slurm/h200-ib", labels=OWNER)
    config["num_nodes"] = 8  # 64 GPUs: the per-user cap exactly
    assert _apply(sky, config).num_nodes == 8


def test_rejects_request_over_the_per_user_cap(sky):
    config = _spec("train", infra="slurm/h200-ib", labels=OWNER)
    config["num_nodes"] = 9  # 72 > 64 per user
    _rejected(sky, config, "per-user cap of 64")


def test_rejects_production_pool_without_the_low_priority(sky):
    config = _spec("eval", infra="k8s/inference-prod", labels=OWNER)
    config["config"] = {"kubernetes": {"pod_config": {"spec": {"priorityClassName": "production-high"}}}}
    _rejected(sky, config, "production-high")


def test_rejects_infra_outside_the_fleet(sky):
    _rejected(sky, _spec("eval", infra="k8s/somebody-elses", labels=OWNER), "not a pool of the fleet")


def test_a_launch_routed_by_another_fleet_than_the_servers_is_refused_for_its_fleet(sky, tmp_path, monkeypatch):
    """The launcher routed by the shipped fleet, the server's policy reads another (its inference pool on
    another cluster): the refusal names the fleet and the setting that fixes it, not the task file."""
    from gpudoor_pipelines.launch.backends import sky_sdk
    from gpudoor_pipelines.launch.errors import LaunchConfigError
    from gpudoor_pipelines.launch.resolve.fleet import load_fleet
    from gpudoor_pipelines.launch.resolve.request import LaunchRequest, resolve
    from gpudoor_pipelines.launch.resolve.specs import load_spec

    spec = load_spec("eval")
    job = resolve(
        LaunchRequest(spec=spec, inputs=given_inputs(spec), cost_owner="ml-research", asset="evals"), load_fleet()
    )
    servers = yaml.safe_load((SPECS_DIR / "fleet.yaml").read_text())
    servers["pools"]["inference"]["infra"] = "k8s/inference-eu"
    (tmp_path / "fleet.yaml").write_text(yaml.safe_dump(servers))
    monkeypatch.setenv("GPUDOOR_FLEET_FILE", str(tmp_path / "fleet.yaml"))
    with pytest.raises(LaunchConfigError) as refused, sky_sdk.refusals(job):
        _apply(sky, job.config, at_client_side=False)
    (problem,) = refused.value.problems
    assert problem.field == "fleet" and "not a pool of the fleet" in problem.problem
    assert "GPUDOOR_FLEET_FILE" in problem.fix and "--fleet" in problem.fix


def test_controller_requests_pass_through(sky):
    config = {"name": "ctrl", "resources": {"cpus": 2}, "run": "true"}
    task = _apply(sky, config, request="jobs.launch_controller")
    assert "GPUDOOR_POOL" not in task.envs


def test_only_the_server_injects_its_credentials(sky, monkeypatch):
    """A client-side pass never reads the server's credentials from wherever it happens to run."""
    monkeypatch.setenv("GPUDOOR_POLICY_AWS_SECRET_ACCESS_KEY", "very-secret-value")
    task = _apply(sky, _spec("caption", infra="slurm/onprem", labels=OWNER), at_client_side=True)
    assert "AWS_SECRET_ACCESS_KEY" not in task.secrets and "AWS_SECRET_ACCESS_KEY" not in task.envs


def test_a_cluster_launch_is_interactive_whatever_its_name(sky):
    """SkyPilot names a cluster launch `launch`: any cluster that stays up gets autostop."""
    task = _apply(
        sky, _spec("demo", infra="k8s/inference-prod", labels=OWNER), request="launch", cluster_name="my-notebook"
    )
    assert _resources(task).autostop_config is not None and _resources(task).autostop_config.enabled
    assert _resources(task).labels["gpudoor-interactive"] == "true"


def test_server_pass_after_client_pass_changes_nothing(sky, monkeypatch):
    """Client then server (with its credentials): the second pass only adds what the server holds."""
    monkeypatch.setenv("GPUDOOR_LABEL_KEY", "deployment-key")
    monkeypatch.setenv("GPUDOOR_POLICY_LABEL_KEY", "deployment-key")
    first = _apply(
        sky,
        _spec(
            "eval",
            infra="k8s/inference-prod",
            labels={**OWNER, "dagster-run-id": "0123abcd", "dagster-asset": "checkpoint_evals"},
        ),
    )
    second = _apply(sky, first.to_yaml_config(), at_client_side=False)
    # The server names the user itself (it knows who sent the request); everything else is unchanged.
    assert second.envs == first.envs
    without_user = [{k: v for k, v in _resources(t).labels.items() if k != "gpudoor-user"} for t in (first, second)]
    assert without_user[0] == without_user[1]
    assert _resources(second).labels["dagster-run-id"] == "0123abcd"
    assert _resources(second).cluster_config_overrides == _resources(first).cluster_config_overrides


def test_two_pools_on_one_cluster_keep_the_routed_pool(sky, tmp_path, monkeypatch):
    """When two pools share an infra, the pool in the job's label (the client's route) is kept."""
    fleet = yaml.safe_load((SPECS_DIR / "fleet.yaml").read_text())
    fleet["pools"]["spare"] = {**fleet["pools"]["inference"], "env": {"LOCAL_CACHE_DIR": "/spare"}}
    path = tmp_path / "fleet.yaml"
    path.write_text(yaml.safe_dump(fleet))
    monkeypatch.setenv("GPUDOOR_FLEET_FILE", str(path))
    task = _apply(sky, _spec("eval", infra="k8s/inference-prod", labels={**OWNER, "gpudoor-pool": "spare"}))
    assert task.envs["LOCAL_CACHE_DIR"] == "/spare" and _resources(task).labels["gpudoor-pool"] == "spare"
    task = _apply(sky, _spec("eval", infra="k8s/inference-prod", labels=OWNER))
    assert task.envs["LOCAL_CACHE_DIR"] == "/cache/gpudoor"


def test_an_unnamed_task_is_called_so(sky):
    config = {"resources": {"accelerators": "A100:1"}, "run": "true"}
    err = _rejected(sky, config, "no pool of the fleet offers A100:1", at_client_side=False)
    assert "the unnamed task" in str(err.value) and "'None'" not in str(err.value)


def test_the_choice_among_gpu_alternatives_does_not_depend_on_the_hash_seed(tmp_path):
    """SkyPilot keeps a GPU set as a Python set; the policy must not pick by its iteration order."""
    import subprocess
    import sys

    probe = (
        "import sky, json\n"
        "from gpudoor_pipelines.launch.server.policy import mutate_config, task_config\n"
        "from gpudoor_pipelines.launch.resolve.fleet import load_fleet\n"
        "accelerators = {'L4:4': None, 'A100:1': None, 'L4:1': None, 'L40S:1': None}\n"
        "resources = {'accelerators': accelerators}\n"
        "task = sky.Task.from_yaml_config({'name': 'sweep', 'run': 'true', 'resources': resources})\n"
        "print(mutate_config(task_config(task, 't'), load_fleet())['resources']['accelerators'])\n"
    )
    seen = set()
    for seed in ("1", "2", "3"):
        out = subprocess.run(
            [sys.executable, "-c", probe],
            env={**__import__("os").environ, "PYTHONHASHSEED": seed},
            capture_output=True,
            text=True,
            check=True,
        )
        seen.add(out.stdout.strip().splitlines()[-1])
    assert seen == {"L4:1"}


def test_skypilots_own_bookkeeping_on_the_server_is_not_the_users_problem(sky):
    """The server adds `_metadata` to a task, and writes a managed-job pool's spec as `service: {pool: ...}`."""
    from gpudoor_pipelines.launch.resolve.fleet import load_fleet
    from gpudoor_pipelines.launch.server.policy import mutate_config, task_config

    pool_task = sky.Task.from_yaml_config({**_spec("caption", labels=OWNER), "pool": {"workers": 2}})
    config = {**task_config(pool_task, "pool"), "_metadata": {"git_commit": "abc"}}
    assert config["service"] == {"pool": {"workers": 2}}
    mutated = mutate_config(config, load_fleet(), user="ada")
    assert mutated["resources"]["labels"]["gpudoor-pool"] in load_fleet().pools
    served = {**_spec("eval", labels=OWNER), "service": {"readiness_probe": "/", "replicas": 1}}
    _rejected(sky, served, "SkyServe")


def test_file_mounts_skypilot_adds_for_the_launchers_workdir_are_not_refused(sky):
    """A pool's worker launch carries the workdir as file mounts; a task file's own mounts are still refused."""
    from gpudoor_pipelines.launch.resolve.fleet import load_fleet
    from gpudoor_pipelines.launch.server.policy import mutate_config

    mounts = {"~/sky_workdir": "/var/lib/api-server/blobs/abc"}
    launched = {**_spec("caption", labels={**OWNER, "gpudoor-via": "launcher"}), "file_mounts": mounts}
    assert mutate_config(launched, load_fleet(), user="ada")["file_mounts"] == mounts
    _rejected(
        sky,
        {**_spec("caption", labels=OWNER), "file_mounts": {"/data": "s3://somewhere/data"}},
        "transit bucket",
        at_client_side=False,
    )


RUN = {"dagster-run-id": "0123abcd", "dagster-asset": "checkpoint_evals"}


def test_a_run_identity_reaches_the_server_only_when_signed_with_the_deployment_key(sky, monkeypatch):
    """The launcher signs the dagster-* labels; the server keeps them only when the signature checks out
    under its own copy of the key. A task that claims a run by writing the labels itself loses them."""
    monkeypatch.setenv("GPUDOOR_POLICY_LABEL_KEY", "deployment-key")
    forged = _apply(sky, _spec("eval", infra="k8s/inference-prod", labels={**OWNER, **RUN}), at_client_side=False)
    labels = _resources(forged).labels
    assert not any(k.startswith("dagster-") for k in labels) and "gpudoor-signature" not in labels
    assert labels["gpudoor-pool"] == "inference"  # the job itself is accepted

    monkeypatch.setenv("GPUDOOR_LABEL_KEY", "deployment-key")
    signed = _apply(sky, _spec("eval", infra="k8s/inference-prod", labels={**OWNER, **RUN}))  # the client's pass signs
    kept = _resources(_apply(sky, signed.to_yaml_config(), at_client_side=False)).labels
    assert (
        kept["dagster-run-id"] == "0123abcd"
        and kept["gpudoor-signature"] == _resources(signed).labels["gpudoor-signature"]
    )

    # A signature copied onto other labels (another run's id) does not check out.
    replayed = signed.to_yaml_config()
    replayed["resources"]["labels"]["dagster-run-id"] = "ffffffff"
    monkeypatch.delenv("GPUDOOR_LABEL_KEY")
    dropped = _resources(_apply(sky, replayed, at_client_side=False)).labels
    assert "dagster-run-id" not in dropped

    # A server without the key trusts no claimed run at all.
    monkeypatch.delenv("GPUDOOR_POLICY_LABEL_KEY")
    assert "dagster-run-id" not in _resources(_apply(sky, signed.to_yaml_config(), at_client_side=False)).labels


def test_the_server_names_the_user_whatever_the_task_says(sky):
    """Who launched comes from SkyPilot's authenticated user, never from the task's own gpudoor-user label."""
    from gpudoor_pipelines.launch.resolve.fleet import load_fleet
    from gpudoor_pipelines.launch.server.policy import mutate_config

    config = _spec("eval", infra="k8s/inference-prod", labels={**OWNER, "gpudoor-user": "someone-else"})
    out = mutate_config(config, load_fleet(), user="alice", at_client_side=False)
    assert out["resources"]["labels"]["gpudoor-user"] == "alice"


def test_a_raw_task_with_skypilots_own_settings_is_not_refused_for_them(sky):
    """SkyPilot's client adds its API server's URL to a task it sends; the server does not take it for a path."""
    from gpudoor_pipelines.launch.resolve.fleet import load_fleet
    from gpudoor_pipelines.launch.server.policy import mutate_config

    config = _spec("eval", infra="k8s/inference-prod", labels=OWNER)
    config["envs"] = {**(config.get("envs") or {}), "SKYPILOT_API_SERVER_ENDPOINT": "http://127.0.0.1:46580"}
    out = mutate_config(config, load_fleet(), user="alice", at_client_side=False)
    assert out["resources"]["labels"]["gpudoor-pool"] == "inference"


def _held(monkeypatch, *, pools: dict[str, int] | None = None, onto_warm_pool: bool = False, consolidated: bool = True):
    """What the server reads as held now (its own jobs tables, faked: no jobs controller runs here)."""
    from gpudoor_pipelines.launch.resolve.usage import Usage
    from gpudoor_pipelines.launch.server import policy

    usage = Usage(gpus=dict(pools or {})) if consolidated else None
    monkeypatch.setattr(policy, "server_usage", lambda: usage)
    monkeypatch.setattr(policy, "_onto_warm_pool", lambda: onto_warm_pool)


def test_the_server_holds_a_launch_to_what_is_held_now_and_names_the_full_pool(sky, monkeypatch):
    from gpudoor_pipelines.launch.errors import PoolFull

    config = _spec("train", infra="slurm/h200-ib", labels=OWNER)  # 2 nodes x 8 H200
    _held(monkeypatch, pools={"h200": 112})
    assert _apply(sky, config, at_client_side=False).num_nodes == 2  # 112 + 16 = 128: the cap exactly
    _held(monkeypatch, pools={"h200": 120})
    with pytest.raises(sky.exceptions.UserRequestRejectedByPolicy) as e:
        _apply(sky, config, at_client_side=False)
    full = PoolFull.from_refusal(str(e.value), "train.yaml")
    assert full is not None and full.pool == "h200" and "at its cap (120/128 GPUs in use, 16 asked)" in str(full)


def test_relaunches_after_preemption_and_jobs_onto_warm_pools_are_not_held_to_live_caps(sky, monkeypatch):
    config = _spec("train", infra="slurm/h200-ib", labels=OWNER)
    _held(monkeypatch, pools={"h200": 128})
    # SkyPilot's controller launching the job's cluster again after a preemption: the job was admitted.
    assert _apply(sky, config, request="jobs.launch_cluster", at_client_side=False).num_nodes == 2
    _held(monkeypatch, pools={"h200": 128}, onto_warm_pool=True)  # the pool's workers hold the GPUs
    assert _apply(sky, config, at_client_side=False).num_nodes == 2
    # A size over the cap is refused whatever is held.
    config["num_nodes"] = 17
    with pytest.raises(sky.exceptions.UserRequestRejectedByPolicy, match="over pool 'h200' cap of 128"):
        _apply(sky, config, at_client_side=False)


def test_a_preempted_jobs_relaunch_in_the_region_it_ran_in_goes_back_onto_its_pool(sky, tmp_path, monkeypatch):
    # A fleet whose pools are partitions of one Slurm cluster: SkyPilot's FAILOVER recovery first asks
    # for the region the job ran in (the cluster, partition dropped).
    fleet = yaml.safe_load((SPECS_DIR / "fleet.yaml").read_text())
    fleet["pools"]["h200"]["infra"] = "slurm/h200-ib/train"
    path = tmp_path / "fleet.yaml"
    path.write_text(yaml.safe_dump(fleet))
    monkeypatch.setenv("GPUDOOR_FLEET_FILE", str(path))
    config = _spec("train", infra="slurm/h200-ib", labels={**OWNER, "gpudoor-pool": "h200"})
    # Every pass of the rules the relaunch goes through: the controller's own (client side), the server's.
    for request, at_client_side in (("launch", True), ("validate", False), ("jobs.launch_cluster", False)):
        relaunch = _resources(_apply(sky, config, request=request, at_client_side=at_client_side))
        assert (relaunch.region, relaunch.zone) == ("h200-ib", "train") and relaunch.labels["gpudoor-pool"] == "h200"
    # A whole region with no pool of the job's to go back to is refused, saying which pools there are.
    unlabelled = _spec("train", infra="slurm/h200-ib", labels=OWNER)
    _rejected(
        sky,
        unlabelled,
        "'slurm/h200-ib' is not a pool of the fleet",
        request="jobs.launch_cluster",
        at_client_side=False,
    )
    elsewhere = _spec("train", infra="slurm/h200-ib", labels={**OWNER, "gpudoor-pool": "onprem"})
    _rejected(sky, elsewhere, "'slurm/h200-ib' is not a pool of the fleet", at_client_side=False)


def test_a_step_cluster_is_held_to_what_is_held_now_and_is_not_interactive(sky, monkeypatch):
    """A step the fleet launches as a cluster (``gpudoor-step-…``) holds GPUs like a job: the caps count it,
    and it gets no autostop or time to live (its step tears it down, or the reconciler once its run ends)."""
    config = _spec("smoke", infra="slurm/h200-ib", labels=OWNER)
    _held(monkeypatch, pools={"h200": 127})
    task = _apply(sky, config, request="launch", cluster_name="gpudoor-step-smoke-1-ab12", at_client_side=False)
    assert "gpudoor-interactive" not in _resources(task).labels and _resources(task).autostop_config is None
    _held(monkeypatch, pools={"h200": 128})
    with pytest.raises(sky.exceptions.UserRequestRejectedByPolicy, match=r"\[gpudoor: pool full\] pool 'h200'"):
        _apply(sky, config, request="launch", cluster_name="gpudoor-step-smoke-1-ab12", at_client_side=False)
    # Any other cluster is interactive and not held to what is held now (its size is checked).
    task = _apply(sky, config, request="launch", cluster_name="lab-smoke", at_client_side=False)
    assert _resources(task).labels["gpudoor-interactive"] == "true"


def test_a_fleet_counting_live_caps_on_the_server_refuses_launches_the_server_cannot_count(sky, monkeypatch, tmp_path):
    fleet = yaml.safe_load((SPECS_DIR / "fleet.yaml").read_text())
    path = tmp_path / "fleet.yaml"
    path.write_text(yaml.safe_dump({**fleet, "live_caps": "server"}))
    monkeypatch.setenv("GPUDOOR_FLEET_FILE", str(path))
    _held(monkeypatch, consolidated=False)
    config = _spec("eval", infra="k8s/inference-prod", labels=OWNER)
    with pytest.raises(sky.exceptions.UserRequestRejectedByPolicy, match="live_caps.*consolidation mode"):
        _apply(sky, config, at_client_side=False)
    path.write_text(yaml.safe_dump({**fleet, "live_caps": "launcher"}))  # the launcher counted them
    assert _apply(sky, config, at_client_side=False).num_nodes == 1


def test_the_server_reads_what_running_and_pending_jobs_and_warm_pools_hold(monkeypatch):
    """From the jobs controller's tables in the server's process: a pending job by the task it was launched with."""
    monkeypatch.undo()  # the real reading, not the tables _server_counts fakes
    from sky.jobs import utils as managed_job_utils

    from gpudoor_pipelines.launch.server import policy

    pending_task = yaml.safe_dump_all(
        [
            {"name": "t"},
            {
                "num_nodes": 2,
                "resources": {"accelerators": "H200:8", "labels": {"gpudoor-pool": "h200", "gpudoor-user": "bob"}},
            },
        ]
    )
    jobs = [
        {
            "job_id": 1,
            "labels": {"gpudoor-pool": "h200", "gpudoor-user": "alice"},
            "accelerators": {"H200": 8},
            "resources": "4x[H200:8]",
        },
        {"job_id": 2, "labels": None, "accelerators": None, "resources": "-", "user_yaml": pending_task, "task_id": 0},
        {"job_id": 3, "labels": None, "pool": "gpudoor-caption-1", "resources": "-"},  # on a warm pool
        {"job_id": 4, "labels": {"team": "x"}, "accelerators": {"L4": 1}, "resources": "1x[L4:1]"},  # not the door's
    ]
    pool_yaml = yaml.safe_dump(
        {"resources": {"accelerators": "L4:1", "labels": {"gpudoor-pool": "onprem", "gpudoor-user": "night"}}}
    )
    monkeypatch.setattr(managed_job_utils, "is_consolidation_mode", lambda: True)
    monkeypatch.setattr(
        managed_job_utils, "get_managed_job_queue", lambda **kw: {"jobs": jobs} if kw["skip_finished"] else {}
    )
    monkeypatch.setattr(
        policy, "_warm_pools", lambda: [{"status": "READY", "pool_yaml": pool_yaml, "target_num_replicas": 3}]
    )
    # A step the fleet launches as a cluster of its own (the smoke test): its cluster holds its GPUs.
    smoke = types.SimpleNamespace(
        launched_nodes=1,
        launched_resources=types.SimpleNamespace(
            labels={"gpudoor-pool": "h200", "gpudoor-user": "carol"}, accelerators={"H200": 1}
        ),
    )
    monkeypatch.setattr(
        policy, "_step_clusters", lambda: [{"name": "gpudoor-step-smoke-1-ab12", "status": "UP", "handle": smoke}]
    )
    usage = policy.server_usage()
    assert usage.gpus == {"h200": 32 + 16 + 1, "onprem": 3}
    assert usage.user_gpus == {("alice", "h200"): 32, ("bob", "h200"): 16, ("carol", "h200"): 1, ("night", "onprem"): 3}
    monkeypatch.setattr(managed_job_utils, "is_consolidation_mode", lambda: False)
    assert policy.server_usage() is None
