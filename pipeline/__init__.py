"""The pipeline service: PySpark computes per-key state, writes snapshot versions and publishes them.

Entry point: `pipeline.build.build`; `pipeline.spec` and `pipeline.errors` import without Spark.
"""
