#!/bin/bash
# A Spark executor in the keyroute image. Spark on Kubernetes starts executor pods with this command (set
# in the executor pod template) and the argument `executor`, and passes everything else as environment:
# the driver's URL, the executor's id, cores, memory, application id, pod IP and name, and its JVM
# options as SPARK_JAVA_OPT_0, SPARK_JAVA_OPT_1, ... (in that order).
set -euo pipefail

if [[ "${1:-}" != "executor" ]]; then
    echo "keyroute-spark-executor: expected the argument 'executor' (got: $*)" >&2
    exit 2
fi

: "${SPARK_HOME:?SPARK_HOME must point at the installed pyspark}"

java_opts=()
while IFS= read -r name; do
    java_opts+=("${!name}")
done < <(compgen -e | grep -E '^SPARK_JAVA_OPT_[0-9]+$' | sort -t_ -k4 -n)

exec "${JAVA_HOME:+$JAVA_HOME/bin/}java" \
    "${java_opts[@]}" \
    "-Xms${SPARK_EXECUTOR_MEMORY}" "-Xmx${SPARK_EXECUTOR_MEMORY}" \
    -cp "${SPARK_CLASSPATH:+$SPARK_CLASSPATH:}${SPARK_HOME}/jars/*" \
    org.apache.spark.scheduler.cluster.k8s.KubernetesExecutorBackend \
    --driver-url "${SPARK_DRIVER_URL}" \
    --executor-id "${SPARK_EXECUTOR_ID}" \
    --cores "${SPARK_EXECUTOR_CORES}" \
    --app-id "${SPARK_APPLICATION_ID}" \
    --hostname "${SPARK_EXECUTOR_POD_IP}" \
    --resourceProfileId "${SPARK_RESOURCE_PROFILE_ID}" \
    --podName "${SPARK_EXECUTOR_POD_NAME}"
