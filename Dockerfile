# syntax=docker/dockerfile:1
# keyroute's two images, two targets of this one Dockerfile:
#   serving   routers and state nodes: Python and keyroute, no JRE, no pyspark
#     docker build --target serving -t keyroute-serving:dev .
#   pipeline  the pipeline's Spark driver and executors: keyroute[pipeline] (pyspark, pandas) and OpenJDK 17
#     docker build --target pipeline -t keyroute-pipeline:dev .
#   docker run --rm keyroute-serving:dev partition --partitions 12 foobar
# Every option is also an environment variable (KEYROUTE_ZK, KEYROUTE_PORT, ...): see README.
# Every Python package is pinned to an exact version by deploy/docker/constraints.txt.

# bookworm, the Debian release with OpenJDK 17 (Spark 4 runs on Java 17 or 21; on a trixie base, install
# openjdk-21-jre-headless instead). Pinned by digest: the multi-platform index of python:3.11-slim-bookworm
# (Python 3.11.16, Debian snapshot of 2026-08-24) as published for the official image, so a rebuild
# starts from the same bytes until this line changes. To move to a newer one:
#   docker buildx imagetools inspect python:3.11-slim-bookworm   # the index's Digest
FROM python:3.11-slim-bookworm@sha256:0bee7276f83efd4a1ee05bbbf4281d95ed28e079220a9457f25a93e3f1e3c31b AS base
# tini as PID 1: it forwards SIGTERM to keyroute (which a shell or Python as PID 1 would not be sent by
# default) and reaps orphaned children (Spark's Python workers, the JVM's helpers).
RUN apt-get update \
    && apt-get install -y --no-install-recommends tini \
    && rm -rf /var/lib/apt/lists/*
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
# A numeric, non-root user, so that Kubernetes' runAsNonRoot can check it (the manifests run as 10001).
RUN groupadd --gid 10001 keyroute \
    && useradd --uid 10001 --gid 10001 --create-home --home-dir /home/keyroute --shell /usr/sbin/nologin keyroute

# keyroute built once, as a wheel, from the sources only (see .dockerignore); neither image keeps them.
# Compiled: KEYROUTE_COMPILE=1 has setup.py build the modules of a read (router and node) with mypyc (a C
# compiler here, mypy as a build requirement of this build only); the images get the wheel, not the compiler.
FROM base AS wheel
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*
ENV KEYROUTE_COMPILE=1
WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY keyroute ./keyroute
COPY router ./router
COPY state_node ./state_node
COPY pipeline ./pipeline
RUN pip wheel --no-deps --wheel-dir /wheels .

FROM base AS pipeline
# The JRE for Spark (driver and executors). The man directory is missing from slim images and the JRE's
# post-install script needs it.
RUN mkdir -p /usr/share/man/man1 \
    && apt-get update \
    && apt-get install -y --no-install-recommends openjdk-17-jre-headless \
    && rm -rf /var/lib/apt/lists/*
RUN --mount=type=bind,from=wheel,source=/wheels,target=/wheels \
    --mount=type=bind,source=deploy/docker/constraints.txt,target=/tmp/constraints.txt \
    set -- /wheels/keyroute-*.whl \
    && pip install --constraint /tmp/constraints.txt "keyroute[pipeline] @ file://$1"
# Spark's home is the installed pyspark; executors use this same Python (their workers import keyroute).
ENV SPARK_HOME=/usr/local/lib/python3.11/site-packages/pyspark \
    PYSPARK_PYTHON=python3
COPY deploy/docker/spark-executor.sh /usr/local/bin/keyroute-spark-executor
RUN test -d "$SPARK_HOME/jars" && chmod 0755 /usr/local/bin/keyroute-spark-executor
WORKDIR /home/keyroute
USER 10001:10001
ENTRYPOINT ["/usr/bin/tini", "--", "keyroute"]
CMD ["--help"]

# Last, so that a plain `docker build .` makes the lean one.
FROM base AS serving
RUN --mount=type=bind,from=wheel,source=/wheels,target=/wheels \
    --mount=type=bind,source=deploy/docker/constraints.txt,target=/tmp/constraints.txt \
    pip install --constraint /tmp/constraints.txt /wheels/keyroute-*.whl
WORKDIR /home/keyroute
USER 10001:10001
EXPOSE 8000 8080
ENTRYPOINT ["/usr/bin/tini", "--", "keyroute"]
CMD ["--help"]
