"""The transit bucket: data crosses clusters only through it (a local folder or an S3 bucket).

``bucket`` is the storage layer itself, free of Dagster so that jobs import it on the GPU nodes;
``pipes``, ``resource`` and ``io_manager`` are its Dagster side.
"""
