"""Reference GPU workloads: the programs that run on the GPU nodes.

Each program is launched as ``python -m workloads.<name>`` from the project root, takes everything
from environment variables, reads and writes ``file://`` or ``s3://`` URIs, and reports to Dagster
through Pipes when launched by it:

* ``workloads.caption``: caption the shards of one job of a batch into Parquet parts (resumable at
  the last part).
* ``workloads.train``: train the small colour/shape model, multi-node with DDP, checkpointing and
  resuming from the transit bucket.
* ``workloads.evaluate``: score a checkpoint on the held-out images.
* ``workloads.serve``: serve a checkpoint over HTTP as a demo.

They depend on torch, pillow, boto3, pandas/pyarrow and dagster-pipes, and on the Dagster-free
storage layer ``gpudoor_pipelines.transit`` (``bucket``, ``s3``, ``uris``; in the workdir), never on
``dagster``, so a GPU node needs nothing else installed.
"""
