//! Who this process is in the job: read from torchrun's variables (also set by
//! `ft launch`), else Slurm's, else a single process.

use anyhow::{bail, Context, Result};
use std::net::{TcpListener, UdpSocket};

/// Where the rank information came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EnvSource {
    /// RANK / WORLD_SIZE / LOCAL_RANK / LOCAL_WORLD_SIZE / MASTER_ADDR / MASTER_PORT
    /// (torchrun, `ft launch`).
    Torchrun,
    /// SLURM_PROCID / SLURM_NTASKS / SLURM_LOCALID / … (`srun ft …`).
    Slurm,
    /// None of the above: one process, world size 1.
    SingleProcess,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DistEnv {
    pub rank: usize,
    pub world_size: usize,
    pub local_rank: usize,
    pub local_world_size: usize,
    pub master_addr: String,
    pub master_port: u16,
    pub source: EnvSource,
    /// torchrun's agent already hosts the store at MASTER_ADDR:MASTER_PORT
    /// (TORCHELASTIC_USE_AGENT_STORE=True): every rank connects as a client.
    pub agent_store: bool,
}

fn parse<T: std::str::FromStr>(name: &str, value: &str) -> Result<T> {
    value
        .trim()
        .parse()
        .map_err(|_| anyhow::anyhow!("environment variable {name}={value:?} is not a valid non-negative integer"))
}

/// Slurm writes tasks per node as "4", "4(x2)" or "2(x3),1"; the first count is this layout's width.
fn first_task_count(value: &str) -> Option<usize> {
    value.split([',', '(']).next()?.trim().parse().ok()
}

impl DistEnv {
    pub fn from_env() -> Result<DistEnv> {
        DistEnv::from_vars(|name| std::env::var(name).ok())
    }

    /// `get` looks up an environment variable; tests pass their own.
    pub fn from_vars(get: impl Fn(&str) -> Option<String>) -> Result<DistEnv> {
        let required = |name: &str| -> Result<String> {
            get(name).with_context(|| format!("environment variable {name} is not set"))
        };
        let env = if get("RANK").is_some() || get("WORLD_SIZE").is_some() {
            let rank = parse("RANK", &required("RANK")?)?;
            let world_size = parse("WORLD_SIZE", &required("WORLD_SIZE")?)?;
            DistEnv {
                rank,
                world_size,
                local_rank: get("LOCAL_RANK").map(|v| parse("LOCAL_RANK", &v)).transpose()?.unwrap_or(rank),
                local_world_size: get("LOCAL_WORLD_SIZE")
                    .map(|v| parse("LOCAL_WORLD_SIZE", &v))
                    .transpose()?
                    .unwrap_or(world_size),
                master_addr: get("MASTER_ADDR").unwrap_or_else(|| "127.0.0.1".into()),
                master_port: parse("MASTER_PORT", &required("MASTER_PORT")?)?,
                source: EnvSource::Torchrun,
                agent_store: get("TORCHELASTIC_USE_AGENT_STORE").is_some_and(|v| v.eq_ignore_ascii_case("true")),
            }
        } else if let Some(procid) = get("SLURM_PROCID") {
            let world_size = parse("SLURM_NTASKS", &required("SLURM_NTASKS")?)?;
            let per_node = ["SLURM_STEP_TASKS_PER_NODE", "SLURM_NTASKS_PER_NODE", "SLURM_TASKS_PER_NODE"]
                .iter()
                .find_map(|name| get(name).and_then(|v| first_task_count(&v)))
                .unwrap_or(world_size);
            let job_id: u64 = get("SLURM_JOB_ID").and_then(|v| v.parse().ok()).unwrap_or(0);
            DistEnv {
                rank: parse("SLURM_PROCID", &procid)?,
                world_size,
                local_rank: parse("SLURM_LOCALID", &required("SLURM_LOCALID")?)?,
                local_world_size: per_node,
                master_addr: get("MASTER_ADDR")
                    .or_else(|| get("SLURM_LAUNCH_NODE_IPADDR"))
                    .context("set MASTER_ADDR to the first node's address (Slurm did not give SLURM_LAUNCH_NODE_IPADDR)")?,
                // The job id keeps concurrent jobs sharing a node off each other's port.
                master_port: match get("MASTER_PORT") {
                    Some(port) => parse("MASTER_PORT", &port)?,
                    None => 20000 + (job_id % 20000) as u16,
                },
                source: EnvSource::Slurm,
                agent_store: false,
            }
        } else {
            DistEnv {
                rank: 0,
                world_size: 1,
                local_rank: 0,
                local_world_size: 1,
                master_addr: "127.0.0.1".into(),
                master_port: free_port()?,
                source: EnvSource::SingleProcess,
                agent_store: false,
            }
        };
        env.validate()?;
        Ok(env)
    }

    fn validate(&self) -> Result<()> {
        if self.world_size == 0 {
            bail!("WORLD_SIZE must be at least 1");
        }
        if self.rank >= self.world_size {
            bail!("RANK={} must be below WORLD_SIZE={}", self.rank, self.world_size);
        }
        if self.local_world_size == 0 || self.local_rank >= self.local_world_size {
            bail!(
                "LOCAL_RANK={} must be below LOCAL_WORLD_SIZE={}",
                self.local_rank,
                self.local_world_size
            );
        }
        if self.world_size % self.local_world_size != 0 {
            bail!(
                "WORLD_SIZE={} is not a multiple of LOCAL_WORLD_SIZE={}: every node must run the same number of ranks",
                self.world_size,
                self.local_world_size
            );
        }
        Ok(())
    }

    pub fn node_rank(&self) -> usize {
        self.rank / self.local_world_size
    }

    pub fn num_nodes(&self) -> usize {
        self.world_size / self.local_world_size
    }

    /// The address of this host's interface that routes to the master: the
    /// one Gloo must bind so that peers on other nodes can reach it.
    pub fn local_address(&self) -> Result<String> {
        let socket = UdpSocket::bind("0.0.0.0:0").context("cannot open a UDP socket")?;
        socket
            .connect((self.master_addr.as_str(), self.master_port))
            .with_context(|| format!("MASTER_ADDR={} is not reachable", self.master_addr))?;
        Ok(socket.local_addr()?.ip().to_string())
    }
}

/// A TCP port that is free right now on every address (the OS picks it):
/// rank 0's store listens on all of them, and a port free on 127.0.0.1
/// need not be (a launch on two GPUs once failed its rendezvous so, with
/// EADDRINUSE).
pub fn free_port() -> Result<u16> {
    let listener = TcpListener::bind("0.0.0.0:0").context("cannot bind a local TCP port")?;
    Ok(listener.local_addr()?.port())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn env(vars: &[(&str, &str)]) -> Result<DistEnv> {
        let map: HashMap<String, String> = vars.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        DistEnv::from_vars(|name| map.get(name).cloned())
    }

    #[test]
    fn torchrun_variables() {
        let e = env(&[
            ("RANK", "5"),
            ("WORLD_SIZE", "8"),
            ("LOCAL_RANK", "1"),
            ("LOCAL_WORLD_SIZE", "4"),
            ("MASTER_ADDR", "10.0.0.1"),
            ("MASTER_PORT", "29500"),
        ])
        .unwrap();
        assert_eq!((e.rank, e.world_size, e.local_rank, e.node_rank(), e.num_nodes()), (5, 8, 1, 1, 2));
        assert_eq!(e.source, EnvSource::Torchrun);
        assert!(!e.agent_store);
    }

    #[test]
    fn slurm_variables() {
        let e = env(&[
            ("SLURM_PROCID", "3"),
            ("SLURM_NTASKS", "4"),
            ("SLURM_LOCALID", "1"),
            ("SLURM_STEP_TASKS_PER_NODE", "2(x2)"),
            ("SLURM_LAUNCH_NODE_IPADDR", "10.1.2.3"),
            ("SLURM_JOB_ID", "12345"),
        ])
        .unwrap();
        assert_eq!((e.rank, e.world_size, e.local_rank, e.local_world_size), (3, 4, 1, 2));
        assert_eq!((e.master_addr.as_str(), e.master_port), ("10.1.2.3", 20000 + 12345));
    }

    #[test]
    fn bad_values_are_named() {
        let err = env(&[("RANK", "4"), ("WORLD_SIZE", "4"), ("MASTER_PORT", "1")]).unwrap_err();
        assert!(err.to_string().contains("RANK=4 must be below WORLD_SIZE=4"), "{err}");
        let err = env(&[("RANK", "x"), ("WORLD_SIZE", "4"), ("MASTER_PORT", "1")]).unwrap_err();
        assert!(err.to_string().contains("RANK=\"x\""), "{err}");
        let err = env(&[("RANK", "0"), ("WORLD_SIZE", "2")]).unwrap_err();
        assert!(err.to_string().contains("MASTER_PORT is not set"), "{err}");
        let err = env(&[("RANK", "0"), ("WORLD_SIZE", "6"), ("LOCAL_WORLD_SIZE", "4"), ("MASTER_PORT", "1")])
            .unwrap_err();
        assert!(err.to_string().contains("not a multiple of LOCAL_WORLD_SIZE"), "{err}");
    }

    #[test]
    fn single_process_default() {
        let e = env(&[]).unwrap();
        assert_eq!((e.rank, e.world_size, e.source), (0, 1, EnvSource::SingleProcess));
    }
}
