//! examples/slurm/train.sbatch on one CPU machine: stand-ins for `srun`
//! and `scontrol` start the job's 2 nodes × 2 tasks as local processes with
//! Slurm's variables, as srun does; the script's rendezvous settings and
//! ft's reading of SLURM_* must make one 4-rank job whose hybrid shard
//! groups are the nodes, and a requeued job (`--resume auto`) continues.

use crate::common;
use common::{shared, small_bert, text, without_launcher_env, FT};
use serde_json::Value;
use std::path::Path;
use std::process::Command;

/// `srun` for SLURM_NNODES × SLURM_NTASKS_PER_NODE tasks on this machine:
/// each gets SLURM_PROCID, SLURM_LOCALID, SLURM_NODEID; the step fails if one does.
const FAKE_SRUN: &str = r#"#!/bin/bash
while [[ "$1" == --* ]]; do shift; done
pids=()
for ((node = 0; node < SLURM_NNODES; node++)); do
  for ((local = 0; local < SLURM_NTASKS_PER_NODE; local++)); do
    SLURM_PROCID=$((node * SLURM_NTASKS_PER_NODE + local)) SLURM_LOCALID=$local SLURM_NODEID=$node "$@" &
    pids+=($!)
  done
done
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=$?; done
exit $status
"#;

const FAKE_SCONTROL: &str = "#!/bin/bash\n# scontrol show hostnames NODELIST\necho 127.0.0.1\necho 127.0.0.2\n";

#[test]
fn the_sbatch_example_runs_two_nodes_of_two_ranks_and_resumes_when_requeued() {
    if shared::skipped_without(&[shared::SQUAD]) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let bin = dir.path().join("bin");
    std::fs::create_dir_all(&bin).unwrap();
    for (name, body) in [("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL)] {
        let path = bin.join(name);
        std::fs::write(&path, body).unwrap();
        std::process::Command::new("chmod").arg("+x").arg(&path).status().unwrap();
    }
    let model = small_bert(dir.path(), true);
    let out = dir.path().join("run");
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/slurm/train.sbatch");
    let run = |epochs: &str| {
        let mut command = Command::new("bash");
        without_launcher_env(&mut command);
        command
            .arg(&script)
            .args(["--device", "cpu", "--max-seq-len", "96", "--set", "task.doc_stride=32", "--batch-size", "4"])
            .args(["--train-samples", "64", "--eval-samples", "8", "--epochs", epochs, "--save-every", "4"])
            .env("PATH", format!("{}:{}", bin.display(), std::env::var("PATH").unwrap()))
            .env("FT", FT)
            .env("MODEL", &model)
            .env("TRAIN_FILE", shared::path(shared::SQUAD))
            .env("EVAL_FILE", shared::path(shared::SQUAD))
            .env("OUTPUT_DIR", &out)
            .env("SLURM_JOB_ID", "4242")
            .env("SLURM_JOB_NODELIST", "node[01-02]")
            .env("SLURM_NNODES", "2")
            .env("SLURM_NTASKS", "4")
            .env("SLURM_NTASKS_PER_NODE", "2")
            .env("SLURM_TASKS_PER_NODE", "2(x2)")
            // Both "nodes" are this machine: the first node's address must be one it has.
            .env("MASTER_PORT", ft_core::env::free_port().unwrap().to_string());
        command.output().unwrap()
    };
    let output = run("1");
    assert!(output.status.success(), "{}: {}", output.status, text(&output));
    let summary: Value = serde_json::from_str(&std::fs::read_to_string(out.join("summary.json")).unwrap()).unwrap();
    assert_eq!(summary["world_size"], 4);
    assert_eq!((summary["strategy"].as_str(), summary["shard_group_size"].as_u64()), (Some("hybrid_shard"), Some(2)), "a shard group per node");
    assert_eq!(summary["optimizer_steps"], 4, "64 windows in global batches of 4 x 4 ranks");
    // Requeued with a second epoch: it continues from step 4.
    let output = run("2");
    let log = text(&output);
    assert!(output.status.success(), "{}: {log}", output.status);
    assert!(log.contains("resumed from") && log.contains("at step 4"), "{log}");
    let summary: Value = serde_json::from_str(&std::fs::read_to_string(out.join("summary.json")).unwrap()).unwrap();
    assert_eq!(summary["optimizer_steps"], 8);
}
