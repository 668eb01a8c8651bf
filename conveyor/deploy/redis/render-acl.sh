#!/bin/sh
# Render users.acl: put the SHA-256 of each password from the environment and the key
# namespace into the template, so Redis never sees (and no file holds) a plain password,
# and drop the template's comments (an ACL file has none).
#   render-acl.sh TEMPLATE OUTPUT
# Environment: REDIS_GATEWAY_PASSWORD, REDIS_WORKER_PASSWORD (required),
# REDIS_KEDA_PASSWORD (optional: a random one nobody knows when unset),
# CONVEYOR_NAMESPACE (default conveyor).
set -eu

template=${1:?usage: render-acl.sh TEMPLATE OUTPUT}
output=${2:?usage: render-acl.sh TEMPLATE OUTPUT}
namespace=${CONVEYOR_NAMESPACE:-conveyor}
case $namespace in
    "" | *[!A-Za-z0-9_.-]*) echo "render-acl.sh: bad CONVEYOR_NAMESPACE '$namespace'" >&2; exit 2 ;;
esac

# .env.example's (and secret.example.yaml's) placeholders are known to everyone: refuse them.
for name in REDIS_GATEWAY_PASSWORD REDIS_WORKER_PASSWORD REDIS_KEDA_PASSWORD; do
    eval "value=\${$name:-}"
    case $value in
        change-me*) echo "render-acl.sh: $name is still the example's placeholder '$value': set a secret" >&2; exit 2 ;;
    esac
done

sha256() { printf '%s' "$1" | sha256sum | cut -d' ' -f1; }
gateway=$(sha256 "${REDIS_GATEWAY_PASSWORD:?set REDIS_GATEWAY_PASSWORD}")
worker=$(sha256 "${REDIS_WORKER_PASSWORD:?set REDIS_WORKER_PASSWORD}")
keda=$(sha256 "${REDIS_KEDA_PASSWORD:-$(od -An -N32 -tx1 /dev/urandom | tr -d ' \n')}")

umask 077
sed -e '/^[[:space:]]*#/d' -e '/^[[:space:]]*$/d' \
    -e "s/@NAMESPACE@/$namespace/g" \
    -e "s/@GATEWAY_PASSWORD_SHA256@/$gateway/g" \
    -e "s/@WORKER_PASSWORD_SHA256@/$worker/g" \
    -e "s/@KEDA_PASSWORD_SHA256@/$keda/g" \
    "$template" > "$output"
