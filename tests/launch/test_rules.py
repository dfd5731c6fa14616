"""The fleet rules one by one: each sets what the fleet wants or refuses saying what to change."""

from __future__ import annotations

import copy

from gpudoor_pipelines.launch.errors import PolicyRejection
from gpudoor_pipelines.launch.resolve.fleet import load_fleet
from gpudoor_pipelines.launch.resolve.routing import route
from gpudoor_pipelines.launch.resolve.rules import (
    Draft,
    Injected,
    LaunchContext,
    apply_rules,
    autostop_rule,
    cost_owner_rule,
    env_rule,
    labels_rule,
    placement_rule,
    priority_class_rule,
    secrets_rule,
)
from gpudoor_pipelines.launch.resolve.specs import load_spec

FLEET = load_fleet()
CTX = LaunchContext(
    cost_owner="ml-research",
    user="ada",
    step="eval",
    dagster={"dagster/run-id": "0123abcd", "dagster/asset": "checkpoint_evals"},
)


def _draft(spec="eval", pool=None, ctx=CTX, injected=None, **task_extra) -> Draft:
    s = load_spec(spec)
    task = copy.deepcopy({**s.config, **task_extra})
    return Draft(task, route(s, FLEET, step=spec, pool=pool), ctx, FLEET, injected or Injected(), s.path)


def _refusal(rule, d: Draft) -> PolicyRejection:
    """Runs one rule and returns the one problem it found (every rule runs; problems are collected)."""
    rule(d)
    (problem,) = d.problems
    assert isinstance(problem, PolicyRejection)
    return problem


def test_cost_owner_rule():
    d = _draft()
    cost_owner_rule(d)  # a known owner passes
    assert d.problems == []
    err = _refusal(cost_owner_rule, _draft(ctx=LaunchContext(cost_owner=None)))
    assert "no cost owner" in str(err) and err.field == "labels.gpudoor-cost-owner" and "eval.yaml" in str(err)
    err = _refusal(cost_owner_rule, _draft(ctx=LaunchContext(cost_owner="marketing")))
    assert "unknown cost owner 'marketing'" in str(err) and "ml-research" in str(err)


def test_placement_rule_pins_what_routing_chose():
    d = _draft()
    placement_rule(d)
    assert d.task["resources"]["infra"] == "k8s/inference-prod" and d.task["resources"]["accelerators"] == "L4:1"


def test_priority_class_rule():
    d = _draft()
    priority_class_rule(d)
    assert d.task["config"]["kubernetes"]["pod_config"]["spec"]["priorityClassName"] == "research-preemptible"
    assert d.notes == ["priority class 'research-preemptible' (production pool)"]
    slurm = _draft(pool="onprem")
    priority_class_rule(slurm)
    assert "config" not in slurm.task and slurm.notes == []
    asking_high = _draft(config={"kubernetes": {"pod_config": {"spec": {"priorityClassName": "production-high"}}}})
    err = _refusal(priority_class_rule, asking_high)
    assert "production-high" in str(err) and err.field == "config.kubernetes.pod_config.spec.priorityClassName"


def test_autostop_rule_only_for_interactive_clusters():
    job = _draft()
    autostop_rule(job)
    assert "autostop" not in job.task["resources"]
    demo = _draft("demo", ctx=LaunchContext(cost_owner="ml-research", interactive=True))
    autostop_rule(demo)
    assert demo.task["resources"]["autostop"] == {"idle_minutes": 60, "down": True}
    own = _draft(
        "demo",
        ctx=LaunchContext(cost_owner="ml-research", interactive=True),
        resources={"accelerators": "L4:1", "autostop": {"idle_minutes": 5}},
    )
    autostop_rule(own)
    assert own.task["resources"]["autostop"] == {"idle_minutes": 5}  # the task's own choice is kept


def test_labels_rule_and_the_context_round_trip():
    d = _draft()
    labels_rule(d)
    labels = d.task["resources"]["labels"]
    assert labels["gpudoor-cost-owner"] == "ml-research" and labels["gpudoor-pool"] == "inference"
    assert labels["dagster-run-id"] == "0123abcd" and labels["dagster-asset"] == "checkpoint_evals"
    assert LaunchContext.from_labels(labels).labels() == CTX.labels()


def test_env_rule_pool_paths_win_and_the_server_only_fills_gaps():
    d = _draft(injected=Injected(env={"OUTPUT_URI": "s3://b/out", "CHECKPOINTS_DIR": "/elsewhere"}))
    env_rule(d)
    assert d.task["envs"]["OUTPUT_URI"] == "s3://b/out" and d.task["envs"]["CHECKPOINTS_DIR"] == "/scratch/checkpoints"
    assert d.task["envs"]["GPUDOOR_POOL"] == "inference" and d.task["envs"]["EVAL_BATCH_SIZE"] == "64"
    filled = _draft(injected=Injected(env={"EVAL_BATCH_SIZE": "1", "AWS_REGION": "eu-west-1"}, fill_only=True))
    env_rule(filled)
    assert filled.task["envs"]["EVAL_BATCH_SIZE"] == "64" and filled.task["envs"]["AWS_REGION"] == "eu-west-1"


def test_secrets_rule_keeps_credentials_out_of_env():
    d = _draft(injected=Injected(secrets={"AWS_SECRET_ACCESS_KEY": "s3cr3t-value"}))
    secrets_rule(d)
    env_rule(d)
    assert (
        d.task["secrets"] == {"AWS_SECRET_ACCESS_KEY": "s3cr3t-value"} and "AWS_SECRET_ACCESS_KEY" not in d.task["envs"]
    )


def test_rules_applied_twice_change_nothing():
    spec = load_spec("eval")
    chosen = route(spec, FLEET)
    injected = Injected(env={"OUTPUT_URI": "s3://b/out"}, secrets={"AWS_SECRET_ACCESS_KEY": "x" * 8})
    once = apply_rules(spec.config, chosen, CTX, FLEET, injected, source=spec.path)
    twice = apply_rules(once.config, chosen, LaunchContext.from_labels(once.labels), FLEET, injected, source=spec.path)
    assert twice.config == once.config and twice.notes == once.notes
    assert spec.config["resources"]["accelerators"] == {
        "L4": 1,
        "RTX6000-Ada": 1,
        "H100": 1,
    }  # the spec is never changed
