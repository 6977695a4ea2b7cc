"""The pipeline service: PySpark computes per-key state, writes snapshot versions and publishes them.

Entry point: `keyroute.pipeline.build.build`; `keyroute.pipeline.spec` and `.errors` import without Spark.
"""
