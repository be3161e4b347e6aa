//! The communicator: PyTorch's own c10d (TCPStore rendezvous, Gloo on CPU,
//! NCCL on CUDA) behind a small Rust API with asynchronous work handles and
//! sub-groups; on the CPU, the ranks of one host exchange tensors through
//! shared memory instead (`shm`, `dist.shared_memory`).

use super::shm::SharedMemory;
use crate::env::DistEnv;
use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tch::{Device, Tensor};

pub use ft_sys::Reduction;

/// Which c10d backend to use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum Backend {
    /// NCCL when this rank has a CUDA device, else Gloo.
    #[default]
    Auto,
    Gloo,
    Nccl,
}

impl std::str::FromStr for Backend {
    type Err = anyhow::Error;
    fn from_str(text: &str) -> Result<Backend> {
        match text {
            "auto" => Ok(Backend::Auto),
            "gloo" => Ok(Backend::Gloo),
            "nccl" => Ok(Backend::Nccl),
            other => bail!("unknown backend {other:?}: expected auto, gloo or nccl"),
        }
    }
}

/// A collective that failed, with where it failed.
#[derive(Debug, thiserror::Error)]
#[error("{op} on group '{group}' failed on rank {rank} of {size}: {message}")]
pub struct CommError {
    pub op: &'static str,
    pub group: String,
    pub rank: usize,
    pub size: usize,
    pub message: String,
}

/// The collectives ft issues. Bytes are counted for [`Collective::COUNTED`]
/// (`summary.json`'s `comm_bytes_per_step`); `ft comm-test` times them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Collective {
    AllReduce,
    AllGather,
    ReduceScatter,
    AllToAll,
    Broadcast,
}

impl Collective {
    /// Those a training step sends, in the byte counters' order.
    pub const COUNTED: [Collective; 4] = [Collective::AllReduce, Collective::AllGather, Collective::ReduceScatter, Collective::AllToAll];

    pub fn name(self) -> &'static str {
        match self {
            Collective::AllReduce => "all_reduce",
            Collective::AllGather => "all_gather",
            Collective::ReduceScatter => "reduce_scatter",
            Collective::AllToAll => "all_to_all",
            Collective::Broadcast => "broadcast",
        }
    }

    /// nccl-tests' bus bandwidth factor for `n` ranks: busbw = algbw × factor,
    /// where algbw is over the whole buffer (the gathered output of an
    /// all-gather). It is also the share of that buffer each member sends
    /// under the ring algorithms, and makes numbers comparable across world
    /// sizes with the hardware's peak.
    pub fn bus_factor(self, n: usize) -> f64 {
        let n = n as f64;
        match self {
            Collective::AllReduce => 2.0 * (n - 1.0) / n,
            Collective::AllGather | Collective::ReduceScatter | Collective::AllToAll => (n - 1.0) / n,
            Collective::Broadcast => 1.0,
        }
    }

    /// Bytes one member of a group of `size` sends for a collective whose
    /// input is `bytes` (an all-gather's is its shard, 1/`size` of the whole).
    fn sent(self, bytes: u64, size: usize) -> u64 {
        let whole = if self == Collective::AllGather { bytes * size as u64 } else { bytes };
        (whole as f64 * self.bus_factor(size.max(1))).round() as u64
    }
}

/// Bytes this rank has sent, per collective kind, over every group of its
/// communicator (whoever issued the collective: core or a plug-in).
#[derive(Debug, Default)]
pub struct ByteCounters([AtomicU64; 4]);

impl ByteCounters {
    fn add(&self, kind: Collective, tensor: &Tensor, size: usize) {
        let bytes = (tensor.numel() * tensor.kind().elt_size_in_bytes()) as u64;
        self.add_bytes(kind, kind.sent(bytes, size));
    }

    /// `sent` bytes of `kind` leaving this member.
    fn add_bytes(&self, kind: Collective, sent: u64) {
        let counter = Collective::COUNTED.iter().position(|&k| k == kind).expect("a counted collective");
        self.0[counter].fetch_add(sent, Ordering::Relaxed);
    }

    /// Bytes sent so far, in `Collective::COUNTED`'s order.
    pub fn snapshot(&self) -> [u64; 4] {
        [0, 1, 2, 3].map(|i| self.0[i].load(Ordering::Relaxed))
    }
}

/// A set of ranks that run collectives together: the world, or a sub-group.
/// Clones share the same c10d group (a plug-in's deferred work may keep one).
#[derive(Clone)]
pub struct ProcessGroup {
    inner: Arc<ft_sys::Group>,
    name: String,
    rank: usize,
    ranks: Vec<usize>,
    sent: Arc<ByteCounters>,
    /// `dist.verify_collectives`: this group's calls so far, and what the rank is doing.
    verifier: Option<Arc<Verifier>>,
    /// Every member on this host: CPU tensors go through shared memory, not Gloo.
    local: Option<Arc<SharedMemory>>,
}

/// What `dist.verify_collectives` keeps per group. Plain data behind an
/// `Arc`, so that a plug-in's copy of ft-core, issuing collectives on a
/// clone of the group, counts and reports through the same state.
#[derive(Default)]
struct Verifier {
    calls: AtomicU64,
    /// What issued the collectives now being made (`ProcessGroup::note_caller`).
    caller: std::sync::Mutex<String>,
}

/// The dtypes a verification message names (others: by code).
const VERIFIED_KINDS: [tch::Kind; 8] =
    [tch::Kind::Float, tch::Kind::BFloat16, tch::Kind::Half, tch::Kind::Double, tch::Kind::Int8, tch::Kind::Uint8, tch::Kind::Int, tch::Kind::Int64];

/// A collective in flight (through shared memory: already done). Do not
/// read or write its tensors before `wait`.
#[must_use = "a collective's result is only valid after wait()"]
pub struct Work {
    inner: ft_sys::Work,
    op: &'static str,
    group: String,
    rank: usize,
    size: usize,
}

impl Work {
    /// Gloo: blocks until done. NCCL: orders the current CUDA stream after the
    /// collective and returns at once. Shared memory: returns at once. Errors (a dead peer, a timeout) come back
    /// as `CommError`.
    pub fn wait(self) -> Result<(), CommError> {
        let Work { inner, op, group, rank, size } = self;
        inner
            .wait(Duration::ZERO)
            .map_err(|e| CommError { op, group, rank, size, message: e.0 })
    }
}

impl ProcessGroup {
    /// This rank's index inside the group.
    pub fn rank(&self) -> usize {
        self.rank
    }

    pub fn size(&self) -> usize {
        self.ranks.len()
    }

    /// Global ranks of the members, in group-rank order.
    pub fn ranks(&self) -> &[usize] {
        &self.ranks
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// Says what is about to issue collectives on this group, for the
    /// message `dist.verify_collectives` gives when ranks disagree.
    pub fn note_caller(&self, caller: impl FnOnce() -> String) {
        if let Some(verifier) = &self.verifier {
            *verifier.caller.lock().unwrap_or_else(|e| e.into_inner()) = caller();
        }
    }

    /// With `dist.verify_collectives`: every member shares (kind, elements,
    /// dtype, call number) of the collective it is about to issue — always
    /// the same size, so this exchange itself never mismatches — and a
    /// difference is an error on every member naming both sides.
    fn verify(&self, kind: Collective, tensor: &Tensor) -> Result<(), CommError> {
        self.verify_elements(kind, tensor, tensor.numel() as i64)
    }

    /// [`Self::verify`] with `elements` standing for `tensor`'s size: what
    /// every member passes alike (a row's width, where the rows differ).
    fn verify_elements(&self, kind: Collective, tensor: &Tensor, elements: i64) -> Result<(), CommError> {
        let Some(verifier) = &self.verifier else { return Ok(()) };
        let call = verifier.calls.fetch_add(1, Ordering::Relaxed) as i64;
        let dtype = VERIFIED_KINDS.iter().position(|k| *k == tensor.kind()).map_or(99, |i| i as i64);
        let mine = [kind as i64, elements, dtype, call];
        let describe = |row: &[i64]| {
            let kind = Collective::COUNTED.get(row[0] as usize).map_or("?", |k| k.name());
            let dtype = VERIFIED_KINDS.get(row[2] as usize).map_or("another dtype".to_string(), |k| format!("{k:?}"));
            format!("{kind} of {} {dtype} elements (call {})", row[1], row[3])
        };
        let failed = |message: String| CommError { op: kind.name(), group: self.name.clone(), rank: self.rank, size: self.size(), message };
        let input = Tensor::from_slice(&mine).to_device(tensor.device());
        let output = Tensor::empty([4 * self.size() as i64], (tch::Kind::Int64, tensor.device()));
        self.inner
            .all_gather_into_tensor(&output, &input)
            .and_then(|work| work.wait(Duration::ZERO))
            .map_err(|e| failed(format!("verifying the collective: {}", e.0)))?;
        let all = Vec::<i64>::try_from(output.to_device(Device::Cpu)).map_err(|e| failed(e.to_string()))?;
        if let Some((other, row)) = all.chunks(4).enumerate().find(|(_, row)| *row != mine) {
            let caller = verifier.caller.lock().unwrap_or_else(|e| e.into_inner()).clone();
            return Err(failed(format!(
                "ranks issue different collectives: group rank {} issues {}, group rank {other} issues {} (while {caller}) — every rank must issue the same collectives in the same order with the same sizes (docs/PLUGINS.md)",
                self.rank,
                describe(&mine),
                describe(row)
            )));
        }
        Ok(())
    }

    /// Whether this group's CPU collectives go through shared memory (`dist.shared_memory`).
    pub fn shared_memory(&self) -> bool {
        self.local.is_some()
    }

    /// Runs a collective: through shared memory where the group has it and
    /// the collective's tensors are `on_cpu` (done as it returns), else
    /// `launch`es it on the c10d group.
    fn run(
        &self,
        op: &'static str,
        on_cpu: bool,
        local: impl FnOnce(&SharedMemory) -> std::result::Result<(), String>,
        launch: impl FnOnce(&ft_sys::Group) -> ft_sys::Result<ft_sys::Work>,
    ) -> Result<Work, CommError> {
        let launched = match self.local.as_deref().filter(|_| on_cpu) {
            Some(memory) => local(memory).map(|()| ft_sys::Work::done()).map_err(ft_sys::ShimError),
            None => launch(&self.inner),
        };
        self.work(op, launched)
    }

    fn work(&self, op: &'static str, launched: ft_sys::Result<ft_sys::Work>) -> Result<Work, CommError> {
        let (group, rank, size) = (self.name.clone(), self.rank, self.size());
        match launched {
            Ok(inner) => Ok(Work { inner, op, group, rank, size }),
            Err(e) => Err(CommError { op, group, rank, size, message: e.0 }),
        }
    }

    /// In place: every member ends with the reduction of all members' `tensor`.
    pub fn all_reduce(&self, tensor: &mut Tensor, reduction: Reduction) -> Result<Work, CommError> {
        self.verify(Collective::AllReduce, tensor)?;
        self.sent.add(Collective::AllReduce, tensor, self.size());
        self.run("all_reduce", tensor.device() == Device::Cpu, |memory| memory.all_reduce(tensor, reduction), |group| group.all_reduce(tensor, reduction))
    }

    /// `output` (size × input's length) receives every member's `input`, in group-rank order.
    pub fn all_gather_into_tensor(&self, output: &mut Tensor, input: &Tensor) -> Result<Work, CommError> {
        self.verify(Collective::AllGather, input)?;
        self.sent.add(Collective::AllGather, input, self.size());
        self.run("all_gather", input.device() == Device::Cpu, |memory| memory.all_gather_into_tensor(output, input), |group| group.all_gather_into_tensor(output, input))
    }

    /// `output` receives this rank's chunk of the reduction of all members' `input`.
    pub fn reduce_scatter_tensor(
        &self,
        output: &mut Tensor,
        input: &Tensor,
        reduction: Reduction,
    ) -> Result<Work, CommError> {
        self.verify(Collective::ReduceScatter, input)?;
        self.sent.add(Collective::ReduceScatter, input, self.size());
        self.run("reduce_scatter", input.device() == Device::Cpu, |memory| memory.reduce_scatter_tensor(output, input, reduction), |group| group.reduce_scatter_tensor(output, input, reduction))
    }

    /// `output` receives chunk r of every member r's `input` in group-rank
    /// order: each input and output is `size` equal chunks, chunk i of
    /// member j's input landing as chunk j of member i's output.
    pub fn all_to_all(&self, output: &mut Tensor, input: &Tensor) -> Result<Work, CommError> {
        self.verify(Collective::AllToAll, input)?;
        self.sent.add(Collective::AllToAll, input, self.size());
        self.work("all_to_all", self.inner.all_to_all(output, input))
    }

    /// All-to-all of rows (the first dimension) in variable numbers:
    /// `input_splits[i]` rows of `input` go to member i, and `output`
    /// receives `output_splits[j]` rows from each member j, in group-rank
    /// order. The splits are each member's own (exchange the counts first);
    /// every row has the same width on every member, which
    /// `dist.verify_collectives` checks in place of the sizes.
    pub fn all_to_all_rows(&self, output: &mut Tensor, input: &Tensor, output_splits: &[i64], input_splits: &[i64]) -> Result<Work, CommError> {
        let failed = |message: String| CommError { op: "all_to_all", group: self.name.clone(), rank: self.rank, size: self.size(), message };
        let rows = |t: &Tensor| t.size().first().copied().unwrap_or(0);
        if input_splits.len() != self.size() || output_splits.len() != self.size() {
            return Err(failed(format!("{} input and {} output splits for a group of {}", input_splits.len(), output_splits.len(), self.size())));
        }
        if input_splits.iter().sum::<i64>() != rows(input) || output_splits.iter().sum::<i64>() != rows(output) {
            return Err(failed(format!("splits of {} and {} rows for an input of {} and an output of {}", input_splits.iter().sum::<i64>(), output_splits.iter().sum::<i64>(), rows(input), rows(output))));
        }
        let width = if rows(input) > 0 { input.numel() as i64 / rows(input) } else { input.size().iter().skip(1).product() };
        self.verify_elements(Collective::AllToAll, input, width)?;
        // What leaves this member: every row but those it sends itself.
        let kept = input_splits[self.rank];
        let bytes = ((rows(input) - kept) * width) as u64 * input.kind().elt_size_in_bytes() as u64;
        self.sent.add_bytes(Collective::AllToAll, bytes);
        self.work("all_to_all", self.inner.all_to_all_rows(output, input, output_splits, input_splits))
    }

    /// Every member's `tensor` becomes the group-rank `root`'s.
    pub fn broadcast(&self, tensor: &mut Tensor, root: usize) -> Result<Work, CommError> {
        self.run("broadcast", tensor.device() == Device::Cpu, |memory| memory.broadcast(tensor, root), |group| group.broadcast(tensor, root))
    }

    pub fn barrier(&self) -> Result<Work, CommError> {
        self.run("barrier", true, SharedMemory::barrier_all, ft_sys::Group::barrier)
    }
}

#[derive(Debug, Clone)]
pub struct CommOptions {
    pub backend: Backend,
    /// How long rendezvous and each collective may take before failing.
    pub timeout: Duration,
    /// Check before each collective that every rank issues the same (`dist.verify_collectives`).
    pub verify_collectives: bool,
    /// The CPU collectives of a group whose members share this host go through shared memory (`dist.shared_memory`).
    pub shared_memory: bool,
}

impl Default for CommOptions {
    fn default() -> Self {
        CommOptions { backend: Backend::Auto, timeout: Duration::from_secs(300), verify_collectives: false, shared_memory: true }
    }
}

/// This process's membership in the job: the world group, and what is
/// needed to build sub-groups.
pub struct Communicator {
    env: DistEnv,
    device: Device,
    groups: GroupBuilder,
    world: ProcessGroup,
}

/// What every group of this rank is made with.
struct GroupBuilder {
    store: ft_sys::Store,
    kind: ft_sys::BackendKind,
    timeout: Duration,
    gloo_hostname: String,
    device_index: usize,
    global_rank: usize,
    sent: Arc<ByteCounters>,
    verify: bool,
    shared_memory: bool,
}

impl GroupBuilder {
    /// Creates the c10d group of `members` (this rank among them), rendezvousing
    /// under `prefix` in the store so that groups never share keys.
    fn build(&self, name: &str, prefix: &str, members: &[usize]) -> Result<ProcessGroup> {
        let rank = members.iter().position(|r| *r == self.global_rank).expect("this rank is a member");
        let store = self.store.prefixed(prefix).map_err(anyhow::Error::msg)?;
        let options = ft_sys::GroupOptions {
            kind: self.kind,
            rank,
            size: members.len(),
            timeout: self.timeout,
            device_index: self.device_index,
            gloo_hostname: &self.gloo_hostname,
        };
        let inner = ft_sys::Group::new(&store, &options)
            .map_err(anyhow::Error::msg)
            .with_context(|| format!("creating process group '{name}' (ranks {members:?})"))?;
        let verifier = self.verify.then(Arc::default);
        let local = (self.shared_memory && self.kind == ft_sys::BackendKind::Gloo && members.len() > 1)
            .then(|| SharedMemory::join(&inner, rank, members.len(), self.timeout).map(Arc::new))
            .flatten();
        Ok(ProcessGroup { inner: Arc::new(inner), name: name.to_string(), rank, ranks: members.to_vec(), sent: self.sent.clone(), verifier, local })
    }
}

impl Communicator {
    /// Rendezvous with every rank through the TCPStore at MASTER_ADDR:MASTER_PORT
    /// (rank 0 hosts it, unless torchrun's agent does) and create the world group.
    pub fn init(env: DistEnv, options: &CommOptions) -> Result<Communicator> {
        let kind = match options.backend {
            Backend::Gloo => ft_sys::BackendKind::Gloo,
            Backend::Nccl => ft_sys::BackendKind::Nccl,
            Backend::Auto if tch::Cuda::is_available() => ft_sys::BackendKind::Nccl,
            Backend::Auto => ft_sys::BackendKind::Gloo,
        };
        let device = match kind {
            ft_sys::BackendKind::Gloo => Device::Cpu,
            ft_sys::BackendKind::Nccl => {
                let visible = tch::Cuda::device_count() as usize;
                if env.local_rank >= visible {
                    bail!(
                        "rank {} needs CUDA device {} (LOCAL_RANK) but {visible} are visible: run at most {visible} ranks per node",
                        env.rank,
                        env.local_rank
                    );
                }
                ft_sys::cuda_set_device(env.local_rank).map_err(anyhow::Error::msg)?;
                Device::Cuda(env.local_rank)
            }
        };
        // GLOO_SOCKET_IFNAME, when set, is Gloo's to honour; otherwise bind the
        // interface that routes to the master so peers on other nodes reach us.
        let gloo_hostname =
            if std::env::var_os("GLOO_SOCKET_IFNAME").is_some() { String::new() } else { env.local_address()? };
        let hosts_store = env.rank == 0 && !env.agent_store;
        let store = ft_sys::Store::tcp(&env.master_addr, env.master_port, hosts_store, env.world_size, options.timeout)
            .map_err(anyhow::Error::msg)
            .with_context(|| {
                format!(
                    "rendezvous at {}:{} failed for rank {} of {} (timeout {} s)",
                    env.master_addr,
                    env.master_port,
                    env.rank,
                    env.world_size,
                    options.timeout.as_secs()
                )
            })?;
        let groups = GroupBuilder {
            store,
            kind,
            timeout: options.timeout,
            gloo_hostname,
            device_index: env.local_rank,
            global_rank: env.rank,
            sent: Arc::default(),
            verify: options.verify_collectives,
            shared_memory: options.shared_memory,
        };
        let everyone: Vec<usize> = (0..env.world_size).collect();
        let world = groups.build("world", "ft/world/", &everyone)?;
        Ok(Communicator { env, device, groups, world })
    }

    pub fn env(&self) -> &DistEnv {
        &self.env
    }

    pub fn world(&self) -> &ProcessGroup {
        &self.world
    }

    /// The device this rank computes on: CPU with Gloo, its local GPU with NCCL.
    pub fn device(&self) -> Device {
        self.device
    }

    pub fn backend_name(&self) -> &'static str {
        match self.groups.kind {
            ft_sys::BackendKind::Gloo => "gloo",
            ft_sys::BackendKind::Nccl => "nccl",
        }
    }

    pub fn timeout(&self) -> Duration {
        self.groups.timeout
    }

    /// Bytes this rank has sent per collective kind (`Collective::COUNTED`'s order), over every group.
    pub fn bytes_sent(&self) -> [u64; 4] {
        self.groups.sent.snapshot()
    }

    /// Sums `values` over every rank (collective); every rank gets the sums.
    pub fn sum_over_ranks(&self, values: &[f64]) -> Result<Vec<f64>> {
        let mut t = Tensor::from_slice(values).to_device(self.device);
        self.world.all_reduce(&mut t, Reduction::Sum)?.wait()?;
        Ok(Vec::<f64>::try_from(t.to_device(Device::Cpu))?)
    }

    /// Every rank's `bytes`, in rank order, on every rank (collective): the
    /// lengths first, then the bytes padded to the longest.
    pub fn all_gather_bytes(&self, bytes: &[u8]) -> Result<Vec<Vec<u8>>> {
        let world = self.env.world_size;
        let mut lengths = vec![0.0; world];
        lengths[self.env.rank] = bytes.len() as f64;
        let lengths: Vec<usize> = self.sum_over_ranks(&lengths)?.into_iter().map(|l| l as usize).collect();
        let longest = lengths.iter().copied().max().unwrap_or(0).max(1);
        let mut mine = bytes.to_vec();
        mine.resize(longest, 0);
        let input = Tensor::from_slice(&mine).to_device(self.device);
        let mut output = Tensor::empty([(longest * world) as i64], (tch::Kind::Uint8, self.device));
        self.world.all_gather_into_tensor(&mut output, &input)?.wait()?;
        let all = Vec::<u8>::try_from(output.to_device(Device::Cpu))?;
        Ok(all.chunks(longest).zip(lengths).map(|(chunk, len)| chunk[..len].to_vec()).collect())
    }

    /// Splits the world into disjoint groups; every rank calls this with the
    /// same partition and gets back the group it belongs to.
    pub fn split(&self, name: &str, partition: &[Vec<usize>]) -> Result<ProcessGroup> {
        let mut seen = vec![false; self.env.world_size];
        for rank in partition.iter().flatten() {
            if *rank >= seen.len() || std::mem::replace(&mut seen[*rank], true) {
                bail!("group partition {partition:?} of '{name}' is not a partition of ranks 0..{}", seen.len());
            }
        }
        if seen.iter().any(|s| !s) {
            bail!("group partition {partition:?} of '{name}' leaves ranks out of 0..{}", seen.len());
        }
        let (index, members) = partition
            .iter()
            .enumerate()
            .find(|(_, members)| members.contains(&self.env.rank))
            .expect("checked above: every rank is in the partition");
        self.groups.build(&format!("{name}{index}"), &format!("ft/{name}/{index}/"), members)
    }

    /// The two groups of hybrid sharding: `shard` holds `shard_size` consecutive
    /// ranks (by default one node), `replica` holds the ranks with the same
    /// position in every shard group.
    pub fn hybrid_groups(&self, shard_size: usize) -> Result<(ProcessGroup, ProcessGroup)> {
        self.blocks_and_strides(shard_size, ["shard", "replica"])
    }

    /// Groups of `size` consecutive ranks, and the groups of the ranks
    /// with the same position in each, named `names`.
    pub fn blocks_and_strides(&self, size: usize, names: [&str; 2]) -> Result<(ProcessGroup, ProcessGroup)> {
        let world = self.env.world_size;
        if size == 0 || world % size != 0 {
            bail!("{} group size {size} must divide the world size {world}", names[0]);
        }
        let blocks: Vec<Vec<usize>> = (0..world / size).map(|g| (g * size..(g + 1) * size).collect()).collect();
        let strides: Vec<Vec<usize>> = (0..size).map(|i| (i..world).step_by(size).collect()).collect();
        Ok((self.split(names[0], &blocks)?, self.split(names[1], &strides)?))
    }
}
