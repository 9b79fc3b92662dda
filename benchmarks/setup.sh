#!/usr/bin/env bash
# What the object-store benchmark needs beyond the test extras (run once, from anywhere; .ci/install runs it):
# - s3rver, a real S3-compatible server whose ranged GETs cost what the range costs, into benchmarks/.tools
#   (Node.js 18 or newer and npm; moto, the tests' server, serves a range in the time of its whole object);
# - obstore, the client that measures the server's floor, and s3torchconnector with its DCP reader, for the
#   side-by-side (the `bench` extra).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
if command -v npm > /dev/null; then
  if [ ! -x "$here/.tools/node_modules/.bin/s3rver" ]; then
    npm install --silent --no-audit --no-fund --prefix "$here/.tools" "s3rver@3.7.1" > /dev/null \
      || echo "benchmarks/setup.sh: npm could not install s3rver; the benchmarks that need it will be skipped" >&2
  fi
else
  echo "benchmarks/setup.sh: npm not found; the benchmarks that need s3rver will be skipped" >&2
fi
if ! python -c "import obstore, s3torchconnector.dcp" 2> /dev/null; then
  PYTHONWARNINGS=ignore pip install -q -e "$here/..[bench]"
fi
