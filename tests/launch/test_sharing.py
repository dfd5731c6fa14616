"""Teams sharing the fleet: quotas per cost owner and borrowing, small interactive sessions, budgets, start
soonest and fingerprints, on the pure routing and rules and on the API server's policy (its tables faked: no
jobs controller runs here)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from gpudoor_pipelines.launch.errors import LaunchConfigError
from gpudoor_pipelines.launch.resolve.fleet import parse_fleet
from gpudoor_pipelines.launch.resolve.request import LaunchRequest, resolve
from gpudoor_pipelines.launch.resolve.routing import route
from gpudoor_pipelines.launch.resolve.sharing import Spent, budget_verdict
from gpudoor_pipelines.launch.resolve.specs import load_spec
from gpudoor_pipelines.launch.resolve.usage import Held, Outlook, Usage

POOL = {"gpus": ["L4"], "gpu_cap": 2, "usd_per_gpu_hour": 1.0}


def _fleet(**sharing):
    return parse_fleet(
        {
            "pools": {
                "east": {"infra": "slurm/bed/east", **POOL},
                "west": {"infra": "slurm/bed/west", **POOL},
                "serving": {
                    "infra": "k8s/serving",
                    **POOL,
                    "preemptible": True,
                    "priority_class": "research-low",
                    "interactive_priority_class": "research-interactive",
                    "borrowed_priority_class": "research-borrowed",
                    "max_interactive_gpus": 1,
                },
            },
            "routes": {"probe": ["east", "west"], "serve": ["serving"]},
            "cost_owners": ["red", "blue", "green"],
            "sharing": {"quotas": {"red": {"east": 2}}, **sharing},
        },
        "fleet.yaml",
    )


@pytest.fixture
def spec(tmp_path: Path):
    def make(gpus: int = 1):
        path = tmp_path / f"probe{gpus}.yaml"
        path.write_text(yaml.safe_dump({"name": "probe", "resources": {"accelerators": f"L4:{gpus}"}, "run": "true"}))
        return load_spec(str(path))

    return make


def _held(*rows: tuple) -> Usage:
    return Usage.tally(Held(*row) for row in rows)


def test_a_team_within_its_quota_is_not_refused_for_what_another_team_borrowed(spec):
    fleet = _fleet()
    borrowed = _held(("east", "bob", 2, 0, "blue", True))  # blue borrowed east's two GPUs
    r = route(spec(2), fleet, pool="east", owner="red", usage=borrowed)
    assert r.pool.name == "east" and not r.borrowed
    assert "within the quota of 'red' on 'east' (0 + 2 of 2 GPUs)" in r.quota
    # What red holds on its quota counts: a third GPU is beyond it, and nothing is idle to borrow.
    own = _held(("east", "ana", 2, 0, "red", False))
    with pytest.raises(LaunchConfigError, match=r"'red' holds 2 of its quota of 2 GPUs on 'east'; 1 more is over it"):
        route(spec(1), fleet, pool="east", owner="red", usage=own)


def test_borrowing_is_marked_and_refused_once_nothing_is_idle(spec):
    fleet = _fleet()
    r = route(spec(1), fleet, pool="east", owner="blue", usage=Usage())
    assert r.borrowed and "'blue' has no quota on 'east': borrows 1 of 2 idle GPUs" in r.quota
    job = resolve(LaunchRequest(spec=spec(1), pool="east", cost_owner="blue"), fleet)
    assert job.labels["gpudoor-borrowed"] == "true"
    full = _held(("east", "bob", 1, 0, "blue", True), ("east", "cy", 1, 0, "green", True))
    with pytest.raises(LaunchConfigError) as e:
        route(spec(1), fleet, pool="east", owner="blue", usage=full)
    assert "no idle GPUs to borrow (2/2 in use, 2 of them borrowed)" in str(e.value)
    assert "ask for a quota (sharing.quotas in fleet.yaml)" in str(e.value)
    # A pool nobody has a quota on is shared by its cap alone: nothing is borrowed there.
    west = resolve(LaunchRequest(spec=spec(1), pool="west", cost_owner="blue"), fleet)
    assert "gpudoor-borrowed" not in west.labels and not west.route.borrowed


def test_without_borrowing_a_team_beyond_its_quota_is_refused(spec):
    fleet = _fleet(borrowing=False)
    with pytest.raises(LaunchConfigError, match="'blue' has no quota on 'east', and borrowing is off"):
        route(spec(1), fleet, pool="east", owner="blue", usage=Usage())


def test_a_group_quota_counts_its_pools_together(spec):
    fleet = _fleet(groups={"both": ["east", "west"]}, quotas={"blue": {"both": 3}})
    held = _held(("east", "bob", 2, 0, "blue", False))
    within = route(spec(1), fleet, pool="west", owner="blue", usage=held)
    assert not within.borrowed and "(2 + 1 of 3 GPUs)" in within.quota
    beyond = route(spec(2), fleet, pool="west", owner="blue", usage=held)
    assert beyond.borrowed and "'blue' holds 2 of its quota of 3 GPUs on 'both'" in beyond.quota


@pytest.mark.parametrize(
    "sharing, field, problem",
    [
        ({"quotas": {"red": {"east": 3}}}, "sharing.quotas (on 'east')", "add up to 3 GPUs, over its gpu_cap of 2"),
        ({"quotas": {"red": {"north": 1}}}, "sharing.quotas.red.north", "unknown pool or group 'north'"),
        ({"quotas": {"purple": {"east": 1}}}, "sharing.quotas.purple", "unknown cost owner 'purple'"),
        ({"groups": {"g": ["east", "nope"]}}, "sharing.groups.g[1]", "unknown pool 'nope'"),
        (
            {"groups": {"g": ["east"]}, "quotas": {"red": {"east": 1, "g": 1}}},
            "sharing.quotas.red.g",
            "pool 'east' is under two quotas of 'red'",
        ),
        ({"budgets": {"purple": {"usd": 5}}}, "sharing.budgets.purple", "unknown cost owner 'purple'"),
    ],
)
def test_a_wrong_sharing_section_is_refused_naming_the_field(sharing, field, problem):
    with pytest.raises(LaunchConfigError) as e:
        _fleet(**sharing)
    assert e.value.field == field and problem in e.value.problem, str(e.value)


def test_a_session_is_held_to_the_pools_interactive_limit_at_its_priority_class(spec):
    fleet = _fleet()
    with pytest.raises(LaunchConfigError, match=r"over pool 'serving' limit of 1 per session \(max_interactive_gpus\)"):
        resolve(LaunchRequest(spec=spec(2), pool="serving", interactive=True, cluster_name="lab-x"), fleet)
    session = resolve(LaunchRequest(spec=spec(1), pool="serving", interactive=True, cluster_name="lab-x"), fleet)
    assert session.config["config"]["kubernetes"]["pod_config"]["spec"]["priorityClassName"] == "research-interactive"
    job = resolve(LaunchRequest(spec=spec(2), pool="serving"), fleet)  # a job: the limit is not its
    assert job.config["config"]["kubernetes"]["pod_config"]["spec"]["priorityClassName"] == "research-low"


def test_a_job_on_borrowed_gpus_runs_at_the_borrowed_class_which_a_later_pass_may_replace(spec):
    from gpudoor_pipelines.launch.server.policy import mutate_config

    fleet = _fleet(quotas={"red": {"serving": 2}})
    within = resolve(LaunchRequest(spec=spec(1), pool="serving", cost_owner="red"), fleet)
    pod = within.config["config"]["kubernetes"]["pod_config"]["spec"]
    assert pod["priorityClassName"] == "research-low" and within.labels["gpudoor-borrowed"] == "false"
    # The server counts what is held: red's quota is taken, so the same job borrows; its class is replaced.
    held = _held(("serving", "ana", 2, 0, "red", False))
    server = mutate_config(within.config, fleet, user="ana", at_client_side=False, usage=Usage())
    assert server["resources"]["labels"]["gpudoor-borrowed"] == "false"
    with pytest.raises(LaunchConfigError, match="no idle GPUs to borrow"):
        mutate_config(within.config, fleet, user="ana", at_client_side=False, usage=held)
    half = _held(("serving", "ana", 1, 0, "red", False), ("serving", "bo", 0, 4, "blue", False))
    quota_of_one = _fleet(quotas={"red": {"serving": 1}})
    borrowed = mutate_config(within.config, quota_of_one, user="ana", at_client_side=False, usage=half)
    assert borrowed["resources"]["labels"]["gpudoor-borrowed"] == "true"
    assert borrowed["config"]["kubernetes"]["pod_config"]["spec"]["priorityClassName"] == "research-borrowed"
    # A later pass that counts nothing (the jobs controller launching the job's own cluster) keeps the verdict.
    again = mutate_config(borrowed, quota_of_one, user="ana", at_client_side=False, usage=None)
    assert again["resources"]["labels"]["gpudoor-borrowed"] == "true"
    assert again["config"]["kubernetes"]["pod_config"]["spec"]["priorityClassName"] == "research-borrowed"
    # A class the pool does not hand out is still refused.
    foreign = {**within.config, "config": {"kubernetes": {"pod_config": {"spec": {"priorityClassName": "vip"}}}}}
    with pytest.raises(LaunchConfigError, match="'vip' on production pool 'serving'"):
        mutate_config(foreign, fleet, user="ana", at_client_side=False, usage=None)


def test_the_server_holds_a_dev_cluster_to_the_session_limit_but_not_a_managed_jobs_own_cluster(spec):
    from gpudoor_pipelines.launch.server.policy import mutate_config

    fleet = _fleet()
    config = resolve(LaunchRequest(spec=spec(2), pool="serving"), fleet).config
    with pytest.raises(LaunchConfigError, match="limit of 1 per session"):
        mutate_config(config, fleet, user="ana", interactive=True, session=True, at_client_side=False)
    # The jobs controller launching a managed job's cluster: a cluster launch, not a session.
    out = mutate_config(config, fleet, user="ana", interactive=True, session=False, at_client_side=False)
    assert out["resources"]["accelerators"] == "L4:2"


@pytest.mark.parametrize(
    "spent, left, warning, refused",
    [
        (Spent(5.0, 5.0), "95.0 of 100 GPU-hours, $195.00 of $200 left this week", None, False),
        (Spent(82.0, 90.0), "18.0 of 100 GPU-hours", "82% of its budget", False),
        (Spent(100.0, 150.0), "0 of 100 GPU-hours", "over budget", True),
    ],
)
def test_a_budget_says_what_is_left_warns_from_80_percent_and_refuses_at_100(spent, left, warning, refused):
    fleet = _fleet(budgets={"red": {"gpu_hours": 100, "usd": 200}})
    v = budget_verdict(fleet, "red", {"red": spent})
    assert left in v.left()
    assert (warning in v.warning) if warning else v.warning is None
    assert bool(v.refusal) is refused
    assert budget_verdict(fleet, "blue", {"blue": spent}) is None  # no budget: nothing to say
    only_warns = budget_verdict(
        _fleet(budgets={"red": {"gpu_hours": 100}}, budget_enforce="warn"), "red", {"red": spent}
    )
    assert only_warns.refusal is None


def _free(counts: dict[str, int]) -> Outlook:
    return Outlook(free=lambda r: counts.get(r.pool.name))


def test_a_job_goes_to_the_pool_that_starts_it_soonest(spec):
    fleet = _fleet()
    r = route(spec(1), fleet, step="probe", outlook=_free({"east": 0, "west": 1}))
    assert r.pool.name == "west"
    assert "'east' would queue (0 L4 free), 'west' starts now (1 L4 free)" in r.reason
    # Where the cluster cannot say, the pools' recent queue waits decide.
    waits = route(spec(1), fleet, step="probe", outlook=Outlook(waits={"east": 600.0, "west": 5.0}))
    assert waits.pool.name == "west" and "'east' would queue (median wait 600 s)" in waits.reason
    # Both would queue: the route's order.
    assert route(spec(1), fleet, step="probe", outlook=_free({"east": 0, "west": 0})).pool.name == "east"
    # Both free: the route's order.
    assert route(spec(1), fleet, step="probe", outlook=_free({"east": 2, "west": 2})).pool.name == "east"
    # An explicit pool wins whatever is free.
    assert route(spec(1), fleet, pool="east", outlook=_free({"east": 0, "west": 2})).pool.name == "east"


def test_the_same_inputs_give_the_same_fingerprint(spec):
    fleet = _fleet()
    a = resolve(LaunchRequest(spec=spec(1), pool="east", dagster={"dagster/run-id": "r1"}, user="ana"), fleet)
    b = resolve(LaunchRequest(spec=spec(1), pool="east", dagster={"dagster/run-id": "r2"}, user="bo"), fleet)
    assert a.fingerprint and len(a.fingerprint) == 16 and a.fingerprint == b.fingerprint
    assert a.config["resources"]["labels"]["gpudoor-fingerprint"] == a.fingerprint
    other_pool = resolve(LaunchRequest(spec=spec(1), pool="west"), fleet)
    other_fleet = resolve(LaunchRequest(spec=spec(1), pool="east"), _fleet(quotas={"red": {"east": 1}}))
    assert len({a.fingerprint, other_pool.fingerprint, other_fleet.fingerprint}) == 3
