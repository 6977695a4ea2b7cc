# syntax=docker/dockerfile:1
# The keyroute image: state nodes, routers, and the pipeline (its Spark driver and executors) all run it.
#   docker build -t keyroute:dev .
#   docker run --rm keyroute:dev partition --partitions 12 foobar
# Every option is also an environment variable (KEYROUTE_ZK, KEYROUTE_PORT, ...): see README.

# bookworm, the Debian release with OpenJDK 17 (Spark 4 runs on Java 17 or 21; on a trixie base, install
# openjdk-21-jre-headless instead).
FROM python:3.11-slim-bookworm

# The JRE for Spark (pipeline driver and executors). The man directory is missing from slim images and
# the JRE's post-install script needs it.
RUN mkdir -p /usr/share/man/man1 \
    && apt-get update \
    && apt-get install -y --no-install-recommends openjdk-17-jre-headless \
    && rm -rf /var/lib/apt/lists/*

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# Dependencies and the project in one step, from the sources only (see .dockerignore).
WORKDIR /src
COPY pyproject.toml README.md ./
COPY keyroute ./keyroute
COPY keyroute_core ./keyroute_core
COPY router ./router
COPY state_node ./state_node
COPY pipeline ./pipeline
RUN pip install . \
    && cd / && rm -rf /src

# Spark's home is the installed pyspark; executors use this same Python (their workers import keyroute).
ENV SPARK_HOME=/usr/local/lib/python3.11/site-packages/pyspark \
    PYSPARK_PYTHON=python3
COPY deploy/docker/spark-executor.sh /usr/local/bin/keyroute-spark-executor
RUN test -d "$SPARK_HOME/jars" && chmod 0755 /usr/local/bin/keyroute-spark-executor

# A numeric, non-root user, so that Kubernetes' runAsNonRoot can check it (the manifests run as 10001).
RUN groupadd --gid 10001 keyroute \
    && useradd --uid 10001 --gid 10001 --create-home --home-dir /home/keyroute --shell /usr/sbin/nologin keyroute
WORKDIR /home/keyroute
USER 10001:10001

EXPOSE 8000 8080
ENTRYPOINT ["keyroute"]
CMD ["--help"]
