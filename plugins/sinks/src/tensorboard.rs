//! TensorBoard's event files, written directly: TFRecord framing around
//! `Event` protocol buffers holding one scalar summary per value.

use anyhow::{Context, Result};
use ft_core::metrics::{MetricsSink, Record, SinkRegistration};
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

/// TensorBoard event files (`<output>/tensorboard/events.out.tfevents.*`):
/// TFRecord framing (length, masked CRC-32C of the length, an `Event`
/// protobuf, its masked CRC) with one scalar summary per value.
pub struct TensorBoardSink {
    path: PathBuf,
    out: BufWriter<File>,
    /// The events a file opens with, written with the first record: a run
    /// that fails before its first step leaves an empty file, which marks
    /// no directory as holding a run's outputs (`run_dir::claim`).
    opening: Vec<Vec<u8>>,
}

/// Protocol-buffer encoding of the three messages TensorBoard reads.
mod proto {
    pub fn varint(out: &mut Vec<u8>, mut value: u64) {
        while value >= 0x80 {
            out.push((value as u8) | 0x80);
            value >>= 7;
        }
        out.push(value as u8);
    }

    fn key(out: &mut Vec<u8>, field: u32, wire_type: u32) {
        varint(out, ((field << 3) | wire_type) as u64);
    }

    pub fn double(out: &mut Vec<u8>, field: u32, value: f64) {
        key(out, field, 1);
        out.extend_from_slice(&value.to_le_bytes());
    }

    pub fn float(out: &mut Vec<u8>, field: u32, value: f32) {
        key(out, field, 5);
        out.extend_from_slice(&value.to_le_bytes());
    }

    pub fn int(out: &mut Vec<u8>, field: u32, value: i64) {
        key(out, field, 0);
        varint(out, value as u64);
    }

    pub fn bytes(out: &mut Vec<u8>, field: u32, value: &[u8]) {
        key(out, field, 2);
        varint(out, value.len() as u64);
        out.extend_from_slice(value);
    }
}

/// `SessionLog.status` START, in `Event.session_log` (field 7).
const SESSION_START: i64 = 1;

fn masked_crc(data: &[u8]) -> u32 {
    let crc = crc32c::crc32c(data);
    crc.rotate_right(15).wrapping_add(0xa282_ead8)
}

impl TensorBoardSink {
    /// A new event file in `<dir>/tensorboard/`; for a run continuing from
    /// step `resumed`, one that makes TensorBoard drop the later steps the
    /// earlier files hold.
    pub fn create(dir: &Path, resumed: Option<u64>) -> Result<TensorBoardSink> {
        let dir = dir.join("tensorboard");
        std::fs::create_dir_all(&dir).with_context(|| format!("cannot create {}", dir.display()))?;
        let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
        let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_else(|_| "localhost".into());
        // A new file per run (resumes too): TensorBoard reads all files of a directory in order.
        let path = dir.join(format!("events.out.tfevents.{}.{}.{}", now.as_secs(), host.trim(), std::process::id()));
        let file = File::create(&path).with_context(|| format!("cannot create {}", path.display()))?;
        let mut event = vec![];
        proto::double(&mut event, 1, now.as_secs_f64());
        proto::bytes(&mut event, 3, b"brain.Event:2");
        let mut opening = vec![event];
        if let Some(step) = resumed {
            // As torch's SummaryWriter(purge_step=…) does: a session that
            // starts at the first step this run writes, on which TensorBoard's
            // reader drops every event of that step and after read before it.
            let mut session_log = vec![];
            proto::int(&mut session_log, 1, SESSION_START);
            let mut event = vec![];
            proto::double(&mut event, 1, now.as_secs_f64());
            proto::int(&mut event, 2, step as i64 + 1);
            proto::bytes(&mut event, 7, &session_log);
            opening.push(event);
        }
        Ok(TensorBoardSink { path, out: BufWriter::new(file), opening })
    }

    fn write_record(&mut self, data: &[u8]) -> Result<()> {
        let length = (data.len() as u64).to_le_bytes();
        self.out.write_all(&length)?;
        self.out.write_all(&masked_crc(&length).to_le_bytes())?;
        self.out.write_all(data)?;
        self.out.write_all(&masked_crc(data).to_le_bytes())?;
        self.out.flush().with_context(|| format!("cannot write {}", self.path.display()))
    }
}

impl MetricsSink for TensorBoardSink {
    fn name(&self) -> &str {
        "tensorboard"
    }

    fn record(&mut self, record: &Record) -> Result<()> {
        for event in std::mem::take(&mut self.opening) {
            self.write_record(&event)?;
        }
        let mut summary = vec![];
        for (tag, value) in &record.values {
            let mut entry = vec![];
            proto::bytes(&mut entry, 1, tag.as_bytes());
            proto::float(&mut entry, 2, *value as f32);
            proto::bytes(&mut summary, 1, &entry);
        }
        let mut event = vec![];
        let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
        proto::double(&mut event, 1, now.as_secs_f64());
        proto::int(&mut event, 2, record.step as i64);
        proto::bytes(&mut event, 5, &summary);
        self.write_record(&event)
    }

    fn finish(&mut self) -> Result<()> {
        self.out.flush().with_context(|| format!("cannot write {}", self.path.display()))
    }
}

inventory::submit! {
    SinkRegistration {
        name: "tensorboard",
        summary: "TensorBoard event files in <output>/tensorboard/",
        create: |dir, resumed| Ok(Box::new(TensorBoardSink::create(dir, resumed)?)),
    }
}
