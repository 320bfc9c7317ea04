# check.sh: what the shell tests share, sourced by each: PASS/FAIL lines,
# their count, and the summary whose status is the test's.
passed=0 failed=0

check() { # name, condition status (0: pass)
    if [ "$2" -eq 0 ]; then echo "PASS: $1"; passed=$((passed + 1)); else echo "FAIL: $1"; failed=$((failed + 1)); fi
}

summary() {
    echo "$passed passed, $failed failed"
    [ "$failed" -eq 0 ]
}
