# Sourced by the tests of spread runs (mpi_test.sh, srun_test.sh), which define fail.
# same_run WHAT ONE_REPORT ONE_DIR SPREAD_REPORT SPREAD_DIR: a spread run's report is one process's
# (the folder it saved to aside) and it saved the same files, byte for byte.
same_run() {
  local what=$1 one_report=$2 one=$3 spread_report=$4 spread=$5
  diff <(sed "s|$one|DIR|" "$one_report") <(sed "s|$spread|DIR|" "$spread_report") ||
    fail "$what: the report differs from one process's"
  for f in "$one"/*; do
    cmp "$f" "$spread/$(basename "$f")" || fail "$what: $(basename "$f") differs"
  done
  [ "$(ls "$one" | wc -l)" -eq "$(ls "$spread" | wc -l)" ] || fail "$what: other files"
}
