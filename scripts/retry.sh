# Sourced by install.sh and install_engine.sh: run one install step, quiet unless it fails, and
# run it again when it failed the way a network does. A package index can cut a download short
# (pip then reports a hash mismatch against the index's own hash), reset a connection or time
# out; a second try usually gets the whole file. A failure of any other kind (no such version, a
# build error) fails at once: trying it again would fail the same way, only later.
#   quiet_retry LABEL LOG COMMAND...   (INSTALL_ATTEMPTS=3, INSTALL_RETRY_PAUSE=10 seconds)

TRANSIENT_FAILURE="do not match the hashes|connection (reset|aborted|refused|broken)|timed? ?out|\
temporary failure in name resolution|incompleteread|protocolerror|remotedisconnected|\
http error 5[0-9][0-9]|bad gateway|service unavailable|max retries exceeded"

quiet_retry() {
    local label="$1" log="$2" attempt=1 cause
    local attempts="${INSTALL_ATTEMPTS:-3}" pause="${INSTALL_RETRY_PAUSE:-10}"
    shift 2
    until "$@" >"$log" 2>&1; do
        # The first line that shows a network failure, for the one-line message; none: not one.
        # (|| true: grep finding nothing is an answer here, not an error for set -e.)
        cause="$(grep -iE -m 1 "$TRANSIENT_FAILURE" "$log" | sed -E 's/^[[:space:]]+//' \
            | cut -c1-160 || true)"
        if [ "$attempt" -ge "$attempts" ] || [ -z "$cause" ]; then
            cat "$log" >&2
            echo "$label: FAILED: $*" >&2
            exit 1
        fi
        echo "$label: a download failed (attempt $attempt of $attempts: $cause);" \
            "again in $pause s" >&2
        sleep "$pause"
        attempt=$((attempt + 1))
    done
}
