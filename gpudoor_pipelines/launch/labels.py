"""The names the door writes on what it launches, in one low module every layer may import.

Labels go on SkyPilot tasks (and so on the clusters and jobs SkyPilot makes of them); run tags go on
Dagster runs; prefixes name the clusters the door or people start.
"""

from __future__ import annotations

# ---------------------------------------------------------------- labels on jobs and clusters
LABEL_COST_OWNER = "gpudoor-cost-owner"
LABEL_POOL = "gpudoor-pool"
LABEL_USER = "gpudoor-user"
LABEL_INTERACTIVE = "gpudoor-interactive"
LABEL_STEP = "gpudoor-step"
LABEL_ASSET = "dagster-asset"
LABEL_RUN_ID = "dagster-run-id"
LABEL_PARTITION = "dagster-partition"
#: Which Dagster deployment launched the job (``GPUDOOR_DEPLOYMENT``): each deployment's reconciler
#: judges only its own jobs, when several share one API server (production and staging).
LABEL_DEPLOYMENT = "dagster-deployment"
#: Set by the door's launcher: the launcher checked the task file itself and filled its inputs.
LABEL_VIA = "gpudoor-via"
#: An interactive cluster's own time to live, in hours (the fleet's ``reconciler`` section caps it).
LABEL_TTL = "gpudoor-ttl-hours"
#: ``"true"`` on a job beyond its cost owner's quota, on a pool's idle GPUs: the first to go when the owner needs them.
LABEL_BORROWED = "gpudoor-borrowed"
#: A hash of the resolved task, the fleet file and the policy's code: same inputs, same fingerprint.
LABEL_FINGERPRINT = "gpudoor-fingerprint"
#: A keyed digest of the job's ``dagster-*`` labels: whoever holds the deployment's key wrote them.
LABEL_SIGNATURE = "gpudoor-signature"
#: The launcher's (and the reconciler's) copy of the deployment's key for ``gpudoor-signature``.
LABEL_KEY_ENV = "GPUDOOR_LABEL_KEY"

# ---------------------------------------------------------------- what jobs get
#: The transit bucket's credentials, which the launcher (or the server) passes to every job as secrets.
TRANSIT_SECRET_NAMES = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN")
#: The env every job is told its pool in.
POOL_ENV = "GPUDOOR_POOL"
#: Where a production pool's priority class goes in a SkyPilot task.
PRIORITY_FIELD = "config.kubernetes.pod_config.spec.priorityClassName"

# ---------------------------------------------------------------- cluster names
#: Cluster-name prefixes of interactive clusters (demos, dev sessions): autostop and a time to live apply.
INTERACTIVE_PREFIXES = ("lab-", "dev-")
#: The clusters the launcher starts for steps launched as clusters (the fleet's ``launch_as``): torn down
#: when their job ends, by the orphan reconciler once their run has ended, never kept for a time to live.
STEP_CLUSTER_PREFIX = "gpudoor-step-"

# ---------------------------------------------------------------- Dagster run tags
#: A run's pool, infra and cost owner for its launches (set in the launchpad, or by a schedule).
TAG_POOL = "gpudoor/pool"
TAG_INFRA = "gpudoor/infra"
TAG_COST_OWNER = "gpudoor/cost-owner"
#: ``gpudoor/job-<asset>-<partition>-<step>``: the job a step launched (a retried step re-attaches to it).
TAG_JOB_PREFIX = "gpudoor/job-"
#: ``gpudoor/released-<kind>-<id>``: how the release of something a run held went.
TAG_RELEASED_PREFIX = "gpudoor/released-"
#: ``<host>:<pid>:<start>``: the process a run executes in, where its steps run in that process (``gpudoor flow``,
#: ``dg.materialize``, the in-process executor): if it is gone, nobody waits for the run's jobs.
TAG_RUN_PROCESS = "gpudoor/run-process"
