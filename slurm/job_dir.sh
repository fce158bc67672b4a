# shellcheck shell=bash
# Sourced by the batch scripts, from the submit dir: the dir a job writes, named after its job id.
#
#   job_dir VAR DEFAULT    VAR keeps the dir you gave it (--export=ALL,VAR=DIR: to go on with a run), else DEFAULT
#
# A requeued job finds its dir again by its id (SLURM_RESTART_COUNT=1, 2, ...). A job Slurm has not restarted whose
# DEFAULT already holds files meets an earlier job's: the controller gave it that job's id again (its state was
# reset, or its ids wrapped), and the run would have gone on from the earlier job's checkpoints or study. That dir is
# moved aside, whole, and the job's log says where.
job_dir() {
  local var=$1 default=$2 aside
  if [ -n "${!var:-}" ]; then
    return
  fi
  if [ "${SLURM_RESTART_COUNT:-0}" = 0 ] && [ -n "$(ls -A "${default}" 2>/dev/null)" ]; then
    aside="${default}.earlier-$(date -r "${default}" +%Y%m%dT%H%M%S)"
    if [ -e "${aside}" ]; then
      aside="${aside}-$$"
    fi
    mv -T -- "${default}" "${aside}" || {
      echo "error: ${default} holds an earlier job ${SLURM_JOB_ID}'s files and cannot be moved aside: move it" \
           "yourself, or pass --export=ALL,${var}=DIR" >&2
      exit 2
    }
    echo "job ${SLURM_JOB_ID}: ${default} held the files of an earlier job ${SLURM_JOB_ID} (the controller gave this" \
         "id again): moved to ${aside}"
  fi
  printf -v "${var}" '%s' "${default}"
}
