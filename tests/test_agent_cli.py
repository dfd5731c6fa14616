"""The door for coding agents: launch → status → logs → cancel, JSON in and out, one exit code per outcome.

Jobs run on the embedded default (the local backend: real processes, real logs, real cancel). The
SkyPilot path of the same commands goes through the same backend interface, which the Slurm test bed
exercises for the assets.
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

import pytest
import yaml

from gpudoor_pipelines.cli.main import main
from tests.conftest import PROJECT_ROOT


def _run(capsys, *argv: str) -> tuple[int, dict]:
    code = main(list(argv))
    out = capsys.readouterr().out
    return code, json.loads(out)  # with --json, stdout is one JSON object and nothing else


def _task(tmp_path, name: str, run: str, **resources) -> str:
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump({"name": name, "resources": resources or {"cpus": 2}, "run": run}))
    return str(path)


def test_an_agent_launches_follows_and_cancels_a_job(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("GPUDOOR_USER", "agent-7")
    spec = _task(tmp_path, "probe", "echo hello-from-the-job; sleep 60")
    code, launched = _run(capsys, "launch", spec, "--json")
    assert code == 0
    job = launched["job_id"]
    assert launched["pool"] == "inference" and launched["accelerators"] is None  # CPU-only: the fleet's cpu_route
    assert launched["user"] == "agent-7" and launched["labels"]["gpudoor-user"] == "agent-7"
    assert launched["cost_owner"] == "ml-research"

    code, state = _run(capsys, "status", job, "--json")
    assert code == 0 and state["job_id"] == job and state["state"] in ("PENDING", "STARTING", "RUNNING")

    deadline = time.monotonic() + 30
    lines: list[str] = []
    while time.monotonic() < deadline and not any("hello-from-the-job" in line for line in lines):
        code, shown = _run(capsys, "logs", job, "--json")
        assert code == 0
        lines = shown["lines"]
        time.sleep(0.3)
    assert any("hello-from-the-job" in line for line in lines)

    code, cancelled = _run(capsys, "cancel", job, "--json")
    assert code == 0 and cancelled["state"] == "CANCELLED" and cancelled["cancel_confirmed"] is True
    code, listed = _run(capsys, "status", "--json")
    assert code == 0 and [j["state"] for j in listed["jobs"] if j["job_id"] == job] == ["CANCELLED"]


def test_a_followed_job_that_fails_exits_3_with_its_last_lines(tmp_path, capsys):
    spec = _task(tmp_path, "broken", "echo about-to-fail; exit 7")
    code, launched = _run(capsys, "launch", spec, "--json")
    assert code == 0
    assert main(["logs", launched["job_id"], "--follow"]) == 3
    out = capsys.readouterr().out
    assert "about-to-fail" in out and "FAILED" in out


def test_with_json_stdout_is_only_json_lines_and_a_job_says_how_long_it_ran(tmp_path, capsys, monkeypatch):
    import logging

    from gpudoor_pipelines.launch.backends.local import LocalBackend

    # What SkyPilot's SDK does while it submits (it cannot run here): progress on stdout, INFO on its logger,
    # whose handler was made before the command ran.
    library = logging.getLogger("gpudoor-tests.sdk")
    handler = logging.StreamHandler()
    library.addHandler(handler)
    library.setLevel(logging.INFO)
    submit = LocalBackend.submit

    def chatty_submit(self, job):
        print("Uploading files to API server")
        library.info("Files uploaded")
        return submit(self, job)

    monkeypatch.setattr(LocalBackend, "submit", chatty_submit)
    spec = _task(tmp_path, "probe", "echo one; sleep 1; echo two")
    try:
        code = main(["launch", spec, "--json", "--follow"])
        captured = capsys.readouterr()
        answers = [json.loads(line) for line in captured.out.splitlines()]  # one complete object per line
        assert code == 0 and "Uploading files" in captured.err and "Files uploaded" not in captured.err
        launched, *lines, final = answers
        job = launched["job_id"]
        assert [a["line"] for a in lines if a["line"] in ("one", "two")] == ["one", "two"]
        assert final["job_id"] == job and final["state"] == "SUCCEEDED"
        assert 1.0 <= final["ran_s"] < 60 and final["queued_s"] is not None and final["queued_s"] >= 0
        code, state = _run(capsys, "status", job, "--json")
        assert code == 0 and state["ran_s"] == final["ran_s"] and state["queued_s"] == final["queued_s"]
        code, cancelled = _run(capsys, "cancel", job, "--json")  # an ended job: nothing to cancel, its times stay
        assert code == 0 and cancelled["ran_s"] == final["ran_s"]
        # --verbose: the libraries' logging is back, on stderr; stdout is still the one answer.
        code = main(["launch", spec, "--json", "--verbose"])
        captured = capsys.readouterr()
        assert code == 0 and "Files uploaded" in captured.err and json.loads(captured.out)["job_id"] != job
    finally:
        library.removeHandler(handler)


def test_the_teams_fleet_file_routes_a_launch_from_the_command_line_or_the_environment(tmp_path, capsys, monkeypatch):
    bed_fleet = str(PROJECT_ROOT / "testbed" / "fleet.yaml")
    spec = _task(tmp_path, "probe", "echo hi", accelerators="L4:1")
    code, shipped = _run(capsys, "where", spec, "--json")
    assert code == 0 and shipped["pool"] == "inference" and "gpudoor-bed" not in shipped["infra"]
    code, answer = _run(capsys, "where", spec, "--json", "--fleet", bed_fleet)
    assert code == 0 and answer["infra"] == "slurm/gpudoor-bed/onprem"
    code, launched = _run(capsys, "launch", spec, "--json", "--fleet", bed_fleet)
    assert code == 0 and launched["infra"] == "slurm/gpudoor-bed/onprem"
    monkeypatch.setenv("GPUDOOR_FLEET_FILE", bed_fleet)  # the variable the API server's policy reads
    code, launched = _run(capsys, "launch", spec, "--json")
    assert code == 0 and launched["infra"] == "slurm/gpudoor-bed/onprem"
    code, _ = _run(capsys, "cancel", launched["job_id"], "--json")


def test_a_refused_file_is_json_with_every_problem_and_exit_2(tmp_path, capsys):
    spec = _task(tmp_path, "bad", "echo hi", accelerators="A100:1")
    path = tmp_path / "bad.yaml"
    config = yaml.safe_load(path.read_text())
    config["envs"] = {"HF_TOKEN": "hf_x"}
    path.write_text(yaml.safe_dump(config))
    code, refused = _run(capsys, "launch", spec, "--json")
    assert code == 2 and refused["error"] == "refused before launch"
    assert {p["field"] for p in refused["problems"]} == {"envs.HF_TOKEN", "resources.accelerators"}
    assert refused["file"] == str(path) and refused["fix"]
    code, _ = _run(capsys, "status", "--json")  # nothing was launched
    assert _ == {"jobs": []}


def test_a_task_that_needs_an_input_is_refused_without_it_naming_the_variable_and_the_flag(tmp_path, capsys):
    """A task declares what it needs the SkyPilot way (``envs: {NAME: null}``): a launch, or a ``where``, that
    does not give it is refused before anything is submitted, naming each variable and the flag that gives it."""
    code, refused = _run(capsys, "launch", "task_specs/eval.yaml", "--json")
    assert code == 2 and refused["error"] == "refused before launch"
    assert {p["field"] for p in refused["problems"]} == {"envs.CHECKPOINT_URI", "envs.DATASET_URI", "envs.OUTPUT_URI"}
    assert all(f"--env {p['field'][len('envs.') :]}=VALUE" in p["fix"] for p in refused["problems"])
    assert refused["file"].endswith("task_specs/eval.yaml")
    code, listed = _run(capsys, "status", "--json")
    assert listed == {"jobs": []}  # nothing was submitted
    code, refused = _run(capsys, "where", "eval", "--json", "--env", "CHECKPOINT_URI=s3://team/ckpt/step-20")
    assert code == 2 and {p["field"] for p in refused["problems"]} == {"envs.DATASET_URI", "envs.OUTPUT_URI"}
    given = {"CHECKPOINT_URI": "s3://team/ckpt/step-20", "DATASET_URI": "s3://team/data.parquet", "OUTPUT_URI": ""}
    code, answer = _run(capsys, "where", "eval", "--json", *(f"--env={k}={v}" for k, v in given.items()))
    assert code == 0 and {k: answer["task_env"][k] for k in given} == given  # an empty value is a value

    # A job gets what --env gives it.
    path = tmp_path / "greet.yaml"
    path.write_text(yaml.safe_dump({"name": "greet", "envs": {"GREETING": None}, "run": "echo got=$GREETING"}))
    code, refused = _run(capsys, "launch", str(path), "--json")
    assert code == 2 and refused["field"] == "envs.GREETING"
    code, launched = _run(capsys, "launch", str(path), "--json", "--env", "GREETING=hello")
    assert code == 0
    assert main(["logs", launched["job_id"], "--follow"]) == 0
    assert "got=hello" in capsys.readouterr().out
    with pytest.raises(SystemExit) as bad:  # not NAME=VALUE: a usage error that says how to write it
        main(["launch", str(path), "--env", "GREETING"])
    assert bad.value.code == 2 and "write NAME=VALUE" in capsys.readouterr().err


def test_an_unknown_job_exits_5(capsys):
    code, answer = _run(capsys, "status", "20260101-000000-abcdef", "--json")
    assert code == 5 and answer["error"] == "no such job" and answer["field"] == "job_id"


def test_an_api_server_that_does_not_answer_exits_4(tmp_path, capsys, monkeypatch):
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("GPUDOOR_BACKEND", "skypilot")
    monkeypatch.setenv("SKYPILOT_API_SERVER_ENDPOINT", f"http://127.0.0.1:{port}")
    code, answer = _run(capsys, "launch", _task(tmp_path, "probe", "echo hi"), "--json")
    assert code == 4 and answer["error"] == "cannot reach the API server"
    assert answer["field"] == "api_server_endpoint" and "SKYPILOT_API_SERVER_ENDPOINT" in answer["fix"]


#: What an agent may pass where a job id goes: none is an id the backend issued.
NOT_JOB_IDS = ["", ".", "..", "/etc", "../jobs", "a/b", "20260101-000000-abcdef/..", "notes.txt", "1/../2", "²"]


@pytest.mark.parametrize("command", [["status"], ["logs"], ["logs", "--follow"], ["cancel"]])
def test_anything_but_an_issued_job_id_is_no_such_job_and_touches_nothing(tmp_path, capsys, command):
    jobs = Path(os.environ["GPUDOOR_HOME"]) / "jobs"
    jobs.mkdir(parents=True, exist_ok=True)
    (jobs / "notes.txt").write_text("a stray file")
    # A job of another home, reachable by a relative path from this home's jobs.
    other = tmp_path / "other-home" / "jobs" / "20260101-000000-abcdef"
    other.mkdir(parents=True)
    (other / "run.log").write_text("a line of another home's job\n")
    (other / "state.json").write_text(json.dumps({"state": "RUNNING"}))
    before = {p: p.read_bytes() for p in [*jobs.parent.rglob("*"), *other.iterdir()] if p.is_file()}
    for job in [*NOT_JOB_IDS, os.path.relpath(other, jobs), str(other)]:
        code, answer = _run(capsys, command[0], job, *command[1:], "--json")
        assert (code, answer["error"], answer["field"]) == (5, "no such job", "job_id"), (job, answer)
        assert "another home" not in json.dumps(answer)
    after = {p: p.read_bytes() for p in [*jobs.parent.rglob("*"), *other.iterdir()] if p.is_file()}
    assert after == before  # no state written, here or in the other home
    code, listed = _run(capsys, "status", "--json")  # the stray file is not a job
    assert (code, listed) == (0, {"jobs": []})


@pytest.mark.parametrize("argv", [["status", "nope"], ["cancel", "nope"], ["logs", "nope"]])
def test_human_mode_says_what_is_wrong_without_a_traceback(capsys, argv):
    assert main(argv) == 5
    err = capsys.readouterr().err
    assert "no such job" in err and "Traceback" not in err


def test_on_skypilot_status_lists_the_agents_jobs_of_the_week_pending_ones_too(capsys, monkeypatch):
    """The listing asks the server only for the week's jobs (not the whole history) and keeps a job still
    waiting for a GPU. The SDK is a fake: an API server with jobs in every state cannot run here."""
    from gpudoor_pipelines.launch.backends import skypilot as skypilot_backend
    from tests.launch.fake_sky import FakeSky, Record, Status, install

    fake = install(monkeypatch, FakeSky("http://127.0.0.1:1"))
    monkeypatch.setattr(skypilot_backend.SkyPilotBackend, "check", lambda self: None)  # no server to ask
    monkeypatch.setenv("GPUDOOR_BACKEND", "skypilot")
    monkeypatch.setenv("SKYPILOT_API_SERVER_ENDPOINT", fake.endpoint)
    monkeypatch.setenv("GPUDOOR_USER", "agent-7")
    now = time.time()
    mine = {"gpudoor-pool": "inference", "gpudoor-user": "agent-7", "gpudoor-cost-owner": "ml-research"}
    theirs = {**mine, "gpudoor-user": "someone-else"}
    fake.records = {
        r.job_id: r
        for r in [
            Record(1, "queued", Status.PENDING, mine, None, "1x[L4:1]", submitted_at=now - 60),
            Record(
                2,
                "done",
                Status.SUCCEEDED,
                mine,
                {"L4": 1},
                "1x[L4:1]",
                submitted_at=now - 3600,
                start_at=now - 3500,
                end_at=now - 3000,
            ),
            Record(
                3, "theirs", Status.RUNNING, theirs, {"L4": 1}, "1x[L4:1]", submitted_at=now - 60, start_at=now - 50
            ),
            Record(
                4,
                "last-month",
                Status.SUCCEEDED,
                mine,
                {"L4": 1},
                "1x[L4:1]",
                submitted_at=now - 30 * 86400,
                start_at=now - 30 * 86400,
                end_at=now - 29 * 86400,
            ),
        ]
    }
    code, listed = _run(capsys, "status", "--json")
    assert code == 0
    assert [(j["job_id"], j["state"]) for j in listed["jobs"]] == [("1", "PENDING"), ("2", "SUCCEEDED")]
    (request,) = fake.queue_requests
    assert request["submitted_after"] == pytest.approx(now - 7 * 86400, abs=60) and request["all_users"]


def test_an_agents_cancel_verifies_the_release_like_a_steps(tmp_path, capsys):
    """``gpudoor cancel`` goes through the launcher's verified release: it answers once the job is terminal and
    its whole process tree is gone, and says what it looked at."""
    import os

    spec = _task(tmp_path, "holder", "sleep 300 & echo child=$!; wait")
    code, launched = _run(capsys, "launch", spec, "--json")
    assert code == 0
    job = launched["job_id"]
    deadline, child = time.monotonic() + 30, None
    while time.monotonic() < deadline and child is None:
        code, shown = _run(capsys, "logs", job, "--json")
        child = next((int(line.split("=", 1)[1]) for line in shown["lines"] if line.startswith("child=")), None)
        time.sleep(0.2)
    assert child is not None
    code, cancelled = _run(capsys, "cancel", job, "--json")
    assert code == 0 and cancelled["state"] == "CANCELLED" and cancelled["cancel_confirmed"] is True
    release = cancelled["release"]
    assert release["kind"] == "job" and release["id"] == job and release["confirmed"] is True
    assert f"job {job}: CANCELLED" in release["seen"] and any(
        s.startswith("process group") and s.endswith("gone") for s in release["seen"]
    )
    # The job's own child went with it (gone, or a zombie nobody has reaped yet).
    stat = f"/proc/{child}/stat"
    assert not os.path.exists(stat) or open(stat).read().rsplit(")", 1)[1].split()[0] == "Z"


def test_where_imports_no_dagster_and_a_task_file_read_before_needs_no_skypilot(tmp_path):
    """An agent asks ``gpudoor where`` in a loop: the answer needs neither Dagster nor, for a task file SkyPilot
    has read before (kept under $GPUDOOR_HOME/cache), SkyPilot; the answer is the same, and a file SkyPilot
    refuses is refused every time, in SkyPilot's words."""
    import subprocess
    import sys

    bad = tmp_path / "bad.yaml"
    bad.write_text(
        yaml.safe_dump({"name": "bad", "resources": {"accelerators": "L4:1", "disk_tier": "warp"}, "run": "x"})
    )
    script = (
        "import json, sys\n"
        "from gpudoor_pipelines.cli.main import main\n"
        "code = main(sys.argv[1:])\n"
        "loaded = sorted({m.split('.')[0] for m in sys.modules} & {'dagster', 'dagster_aws', 'sky'})\n"
        "print(json.dumps({'code': code, 'loaded': loaded}), file=sys.stderr)\n"
    )
    env = {**os.environ, "GPUDOOR_HOME": str(tmp_path / "home")}

    def where(spec: str, *given: str) -> tuple[dict, dict]:
        out = subprocess.run(
            [sys.executable, "-c", script, "where", spec, "--json", *given],
            cwd=PROJECT_ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        return json.loads(out.stdout), json.loads(out.stderr.strip().splitlines()[-1])

    inputs = [f"--env={name}=s3://team/{name.lower()}" for name in ("CHECKPOINT_URI", "DATASET_URI", "OUTPUT_URI")]
    first, first_run = where("task_specs/eval.yaml", *inputs)
    again, again_run = where("task_specs/eval.yaml", *inputs)
    assert first_run == {"code": 0, "loaded": ["sky"]}  # SkyPilot read the file: no Dagster
    assert again_run == {"code": 0, "loaded": []}  # read before: neither
    assert again == first and first["pool"] and first["accelerators"]
    for _ in range(2):
        refused, run = where(str(bad))
        assert run == {"code": 2, "loaded": ["sky"]} and refused["file"] == str(bad)
        assert "SkyPilot" in refused["problem"]


def test_on_skypilot_logs_of_a_job_is_one_request_and_an_unknown_job_is_still_no_such_job(capsys, monkeypatch):
    """Agents read logs in loops: the log's own answer is enough (no look at the queue first), and a job the
    server does not know is still told apart by a look. The SDK is a fake that counts the queue requests."""
    from gpudoor_pipelines.launch.backends import skypilot as skypilot_backend
    from tests.launch.fake_sky import FakeSky, Status, install

    fake = install(monkeypatch, FakeSky("http://127.0.0.1:1"))
    monkeypatch.setattr(skypilot_backend.SkyPilotBackend, "check", lambda self: None)  # no server to ask
    monkeypatch.setenv("GPUDOOR_BACKEND", "skypilot")
    monkeypatch.setenv("SKYPILOT_API_SERVER_ENDPOINT", fake.endpoint)
    fake.add_job(1, Status.SUCCEEDED, {"gpudoor-pool": "onprem"})
    code, shown = _run(capsys, "logs", "1", "--json")
    assert code == 0 and shown["lines"] == ["fake job 1 says hello", "fake job 1 is done"]
    assert fake.queue_requests == []
    # What SkyPilot answers for a job it does not know: one line, no error.
    monkeypatch.setattr(
        fake.jobs, "tail_logs", lambda job_id, output_stream, **_: output_stream.write("Job 7 not found.\n")
    )
    code, shown = _run(capsys, "logs", "7", "--json")
    assert code == 5 and shown["error"] == "no such job" and len(fake.queue_requests) == 1
