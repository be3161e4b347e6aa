//! `ft bench` runs its matrix in its own workers and reports each row, over
//! real ranks on the CPU, with a JSON file and a PNG chart; a
//! configuration that fails is reported as a failed row and the command
//! exits non-zero. `--plan-check` sets each row beside `ft plan`'s prediction.

use crate::common;
use common::{ft, text};
use serde_json::Value;
use std::path::Path;

#[test]
fn bench_runs_a_matrix_and_reports_every_row() {
    let dir = tempfile::tempdir().unwrap();
    let (json, chart) = (dir.path().join("rows.json"), dir.path().join("chart.png"));
    let fixture = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/bloom");
    let output = ft()
        .args(["bench", "--config", fixture.to_str().unwrap(), "--device", "cpu", "--dtype", "f32"])
        .args(["--gpus", "1,2", "--strategy", "ddp,full_shard,not_a_strategy", "--batch", "2", "--seq", "32"])
        .args(["--warmup", "1", "--steps", "2", "--json", json.to_str().unwrap(), "--chart", chart.to_str().unwrap()])
        // CPU rows beside an H100's prediction: only that every row that ran is checked.
        .args(["--plan-check", "--gpu", "h100"])
        .output()
        .unwrap();
    let log = text(&output);
    assert_eq!(output.status.code(), Some(1), "a failed configuration fails the command: {log}");
    assert!(log.contains("| model | strategy |"), "{log}");
    assert!(log.contains("| model | strategy | offload | ckpt | GPUs |") && log.contains("plan check: ") && log.contains(" of 4 rows within"), "{log}");
    let rows: Vec<Value> = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    assert_eq!(rows.len(), 6, "2 GPU counts x 3 strategies");
    let row = |gpus: u64, strategy: &str| rows.iter().find(|r| r["gpus"] == gpus && r["strategy"] == strategy).unwrap();
    for gpus in [1, 2] {
        for strategy in ["ddp", "full_shard"] {
            let r = row(gpus, strategy);
            assert!(r["error"].is_null(), "{r}");
            assert!(r["tokens_per_s_per_gpu"].as_f64().unwrap() > 0.0 && r["loss"].as_f64().unwrap().is_finite(), "{r}");
        }
        let failed = row(gpus, "not_a_strategy");
        assert!(failed["error"].as_str().unwrap().contains("exited with code"), "{failed}");
    }
    // Sharding halves what a rank holds; exposed communication is measured against one GPU.
    let held = |gpus: u64, strategy: &str| row(gpus, strategy)["state"]["optimizer_state"].as_f64().unwrap();
    assert!((held(2, "full_shard") / held(2, "ddp") - 0.5).abs() < 0.01);
    assert!(row(2, "full_shard")["exposed_comm_ms"].as_f64().is_some());
    assert!(row(1, "ddp")["exposed_comm_ms"].is_null());
    let png = std::fs::read(&chart).unwrap();
    assert!(png.starts_with(b"\x89PNG") && png.len() > 10_000, "a PNG chart of the successful rows");
}

#[test]
fn bench_profiles_steps_and_refuses_a_bad_reduce_dtype() {
    let dir = tempfile::tempdir().unwrap();
    let profile = dir.path().join("profile");
    let fixture = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/bloom");
    let base = ["bench", "--config", fixture.to_str().unwrap(), "--device", "cpu", "--dtype", "f32", "--batch", "2", "--seq", "32"];
    let output = ft().args(base).args(["--warmup", "1", "--steps", "1", "--profile", profile.to_str().unwrap()]).output().unwrap();
    assert!(output.status.success(), "{}", text(&output));
    // A Chrome trace PyTorch's profiler wrote, and the time per op, largest first.
    let trace: Value = serde_json::from_str(&std::fs::read_to_string(profile.join("bloom-ddp-1gpu-2x32.trace.json")).unwrap()).unwrap();
    assert!(trace["traceEvents"].as_array().is_some_and(|events| events.iter().any(|e| e["name"] == "aten::mm")), "no aten::mm in the trace");
    let table = std::fs::read_to_string(profile.join("bloom-ddp-1gpu-2x32.kernels.tsv")).unwrap();
    let ms: Vec<f64> = table.lines().skip(1).map(|l| l.split('\t').next().unwrap().parse().unwrap()).collect();
    assert!(ms.len() > 10 && ms.windows(2).all(|w| w[0] >= w[1]), "{table}");

    let output = ft().args(base).args(["--reduce-dtype", "fp8"]).output().unwrap();
    assert!(!output.status.success() && text(&output).contains("expected fp32 or compute"), "{}", text(&output));
}
