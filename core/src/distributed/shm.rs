//! Collectives between the ranks of one host through shared memory
//! (`dist.shared_memory`): on the CPU, Gloo carries every collective over
//! TCP sockets, each through its worker and event-loop threads — 0.7–0.9 ms
//! for a 4 KiB all-reduce between two ranks of one 2-core host, most of it
//! in the kernel (README, "Sharding strategies", has the figures). Here each member copies its part into its slot of a
//! mapped segment, waits at a barrier (a futex in the segment, so a waiting
//! rank sleeps instead of spinning on cores its peers need), and reads the
//! others' parts: one barrier a collective (a chunk of it, for tensors
//! larger than a slot). Every collective completes as it is issued; every
//! member reduces in group-rank order, so all members get the same bits.
//!
//! A group uses it when every member maps the segment its rank 0 made (its
//! pages reserved first: a /dev/shm too small means Gloo, not a crash) and
//! sees the others' processes (one host, one /dev/shm, one PID namespace);
//! otherwise it stays on Gloo, as across hosts. A member that ends while
//! the others wait is found within a tenth of a second (its process gone),
//! as Gloo finds a closed socket; the group's timeout bounds the rest.

use ft_sys::Reduction;
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::sync::atomic::{AtomicI32, AtomicU32, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};
use tch::{Device, Kind, Tensor};

/// Bytes of one member's slot: a chunk of a collective's tensor.
const SLOT_BYTES: usize = 2 << 20;
/// The control words: the barrier's count and generation, each on its own
/// cache line, then the members' process ids.
const GENERATION_OFFSET: usize = 64;
const PIDS_OFFSET: usize = 128;
/// How often a waiting member looks for ended peers.
const PEER_CHECK: Duration = Duration::from_millis(100);

/// One group's segment, mapped in this process.
pub(crate) struct SharedMemory {
    map: memmap2::MmapMut,
    /// The mapping's start, where every member's views of it come from.
    base: *mut u8,
    header: usize,
    rank: usize,
    size: usize,
    timeout: Duration,
    /// Collectives on one group are issued in one order on every member:
    /// one at a time here, whatever thread issues them.
    issuing: Mutex<SlotSets>,
}

// SAFETY: `base` points into `map`, which lives as long as the value;
// every access through it is ordered by the barrier's atomics, and one
// collective runs at a time.
unsafe impl Send for SharedMemory {}
unsafe impl Sync for SharedMemory {}

/// The segment's file under /dev/shm while the members map it.
fn segment_path(name: &str) -> String {
    format!("/dev/shm/{name}")
}

/// `from`'s elements into `into` (a slot's view, or a chunk of a tensor).
fn copy(mut into: Tensor, from: &Tensor) -> Result<(), String> {
    into.f_copy_(from).map_err(|e| e.to_string())
}

impl SharedMemory {
    /// Maps `name` (made by rank 0 with `create`): two sets of `size`
    /// slots (`SlotSets`), and records this member's process id. None where
    /// it cannot: the caller stays on Gloo.
    fn map(name: &str, rank: usize, size: usize, timeout: Duration, create: bool) -> Option<SharedMemory> {
        let header = (PIDS_OFFSET + 4 * size).next_multiple_of(4096);
        let len = header + 2 * size * SLOT_BYTES;
        let path = segment_path(name);
        let opened = std::fs::OpenOptions::new().read(true).write(true).create_new(create).mode(0o600).open(&path);
        // Its pages reserved now: a /dev/shm too small (a container's 64 MiB) fails here, not as SIGBUS at a write.
        let sized = opened.and_then(|file| {
            // SAFETY: a system call on the file's own descriptor.
            let error = if create { unsafe { libc::posix_fallocate(file.as_raw_fd(), 0, len as libc::off_t) } } else { 0 };
            if error == 0 { Ok(file) } else { Err(std::io::Error::from_raw_os_error(error)) }
        });
        // SAFETY: a file of ft's own under a name no one else uses, its size fixed before any member maps it.
        let map = sized.and_then(|file| unsafe { memmap2::MmapMut::map_mut(&file) }).ok().filter(|map| map.len() == len);
        let Some(mut map) = map else {
            if create {
                let _ = std::fs::remove_file(&path);
            }
            return None;
        };
        let base = map.as_mut_ptr();
        let memory = SharedMemory { map, base, header, rank, size, timeout, issuing: Mutex::default() };
        memory.pid(rank).store(std::process::id() as i32, Ordering::Release);
        Some(memory)
    }

    /// Sets up the segment for `group` (Gloo, `size` members, this one
    /// `rank`), exchanging its name and every member's readiness over
    /// `group` itself; None (on every member alike) where some member
    /// cannot use it.
    pub(crate) fn join(group: &ft_sys::Group, rank: usize, size: usize, timeout: Duration) -> Option<SharedMemory> {
        let agree = |ok: bool| -> bool {
            let flag = Tensor::from_slice(&[i32::from(ok)]);
            group.all_reduce(&flag, ft_sys::Reduction::Min).and_then(|work| work.wait(Duration::ZERO)).is_ok() && flag.int64_value(&[0]) == 1
        };
        // Rank 0 names and makes it; the name travels as 64 bytes.
        static SEGMENTS: AtomicU32 = AtomicU32::new(0);
        let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.subsec_nanos());
        let made = format!("ft-{}-{nanos}-{}", std::process::id(), SEGMENTS.fetch_add(1, Ordering::Relaxed));
        let mut memory = (rank == 0).then(|| SharedMemory::map(&made, rank, size, timeout, true)).flatten();
        let mut name = [0u8; 64];
        if memory.is_some() {
            name[..made.len()].copy_from_slice(made.as_bytes());
        }
        let shared = Tensor::from_slice(&name);
        let received = group.broadcast(&shared, 0).and_then(|work| work.wait(Duration::ZERO)).ok().and_then(|()| Vec::<u8>::try_from(&shared).ok());
        let name = received.map_or(String::new(), |bytes| String::from_utf8_lossy(&bytes[..bytes.iter().position(|b| *b == 0).unwrap_or(bytes.len())]).into_owned());
        if rank != 0 {
            memory = (!name.is_empty()).then(|| SharedMemory::map(&name, rank, size, timeout, false)).flatten();
        }
        let mapped = agree(memory.is_some());
        // Every member has mapped it (or given up): the name is no longer needed, nor left behind by a crash.
        if rank == 0 && memory.is_some() {
            let _ = std::fs::remove_file(segment_path(&made));
        }
        if !mapped {
            return None;
        }
        let memory = memory?;
        // Each member's process id is in place; seeing them all means one PID namespace, which finding an ended peer needs.
        let sees_peers = (0..size).all(|member| memory.peer_alive(member));
        agree(sees_peers).then_some(memory)
    }

    fn word<T>(&self, offset: usize) -> &T {
        // SAFETY: offsets inside the header, aligned, of atomics that live as long as the mapping.
        unsafe { &*(self.base.add(offset) as *const T) }
    }

    fn arrived(&self) -> &AtomicU32 {
        self.word(0)
    }

    fn generation(&self) -> &AtomicU32 {
        self.word(GENERATION_OFFSET)
    }

    fn pid(&self, member: usize) -> &AtomicI32 {
        self.word(PIDS_OFFSET + 4 * member)
    }

    fn peer_alive(&self, member: usize) -> bool {
        let pid = self.pid(member).load(Ordering::Acquire);
        // SAFETY: signal 0 only asks whether the process exists.
        pid > 0 && (unsafe { libc::kill(pid, 0) } == 0 || std::io::Error::last_os_error().raw_os_error() == Some(libc::EPERM))
    }

    /// Every member arrives before any leaves. What a member wrote before
    /// arriving is seen by every member after leaving.
    fn barrier(&self) -> Result<(), String> {
        let generation = self.generation();
        let seen = generation.load(Ordering::Acquire);
        if self.arrived().fetch_add(1, Ordering::AcqRel) + 1 == self.size as u32 {
            self.arrived().store(0, Ordering::Relaxed);
            generation.fetch_add(1, Ordering::AcqRel);
            // SAFETY: a futex wake on a word of the shared mapping (not private: other processes wait on it).
            unsafe { libc::syscall(libc::SYS_futex, generation.as_ptr(), libc::FUTEX_WAKE, i32::MAX, std::ptr::null::<libc::timespec>(), 0, 0) };
            return Ok(());
        }
        let deadline = Instant::now() + self.timeout;
        loop {
            for _ in 0..64 {
                if generation.load(Ordering::Acquire) != seen {
                    return Ok(());
                }
                std::hint::spin_loop();
            }
            let wait = libc::timespec { tv_sec: 0, tv_nsec: PEER_CHECK.as_nanos() as libc::c_long };
            // SAFETY: waits while the word still holds `seen`; returns on a wake, a signal or the timeout.
            unsafe { libc::syscall(libc::SYS_futex, generation.as_ptr(), libc::FUTEX_WAIT, seen, &wait as *const libc::timespec, 0, 0) };
            if generation.load(Ordering::Acquire) != seen {
                return Ok(());
            }
            if let Some(ended) = (0..self.size).find(|&member| !self.peer_alive(member)) {
                return Err(format!("group rank {ended} (process {}) ended while the others waited for it in shared memory", self.pid(ended).load(Ordering::Relaxed)));
            }
            if Instant::now() > deadline {
                return Err(format!("timed out after {} s waiting for the group's other ranks in shared memory", self.timeout.as_secs()));
            }
        }
    }

    /// `elements` of `kind` in `member`'s slot of `set`, from element `at`.
    fn slot(&self, set: usize, member: usize, at: usize, elements: usize, kind: Kind) -> Tensor {
        let offset = self.header + (set * self.size + member) * SLOT_BYTES + at * kind.elt_size_in_bytes();
        assert!(offset + elements * kind.elt_size_in_bytes() <= self.map.len(), "a chunk inside its slot");
        // SAFETY: inside the mapping (checked above), which outlives the view: views live within one collective.
        unsafe { Tensor::from_blob(self.base.add(offset), &[elements as i64], &[1], kind, Device::Cpu) }
    }

    fn chunk_elements(kind: Kind) -> usize {
        SLOT_BYTES / kind.elt_size_in_bytes()
    }

    /// `out` becomes the reduction of this group's `parts`, in their order
    /// (`Avg`: their sum divided by the group's size, as Gloo's is).
    fn reduce(&self, out: &Tensor, mut parts: impl Iterator<Item = Tensor>, reduction: Reduction) -> Result<(), String> {
        let mut out = out.shallow_clone();
        copy(out.shallow_clone(), &parts.next().expect("a group has members"))?;
        for part in parts {
            let reduced = match reduction {
                Reduction::Sum | Reduction::Avg => out.f_add_(&part),
                Reduction::Max => out.f_maximum_out(&out, &part),
                Reduction::Min => out.f_minimum_out(&out, &part),
            };
            drop(reduced.map_err(|e| e.to_string())?);
        }
        if reduction == Reduction::Avg {
            drop(out.f_div_scalar_(self.size as f64).map_err(|e| e.to_string())?);
        }
        Ok(())
    }

    /// Runs `collective` on `outputs` and `inputs` made contiguous and
    /// flat, one at a time on this group, copying results back into
    /// `outputs` that were not. Its chunks take turns at the two slot sets.
    fn issue(&self, outputs: &[&Tensor], inputs: &[&Tensor], collective: impl FnOnce(&[Tensor], &[Tensor], &mut SlotSets) -> Result<(), String>) -> Result<(), String> {
        let mut sets = self.issuing.lock().unwrap_or_else(|e| e.into_inner());
        let flat = |t: &Tensor| t.f_contiguous().and_then(|t| t.f_view([-1])).map_err(|e| e.to_string());
        let outs = outputs.iter().map(|t| flat(t)).collect::<Result<Vec<_>, _>>()?;
        let ins = inputs.iter().map(|t| flat(t)).collect::<Result<Vec<_>, _>>()?;
        collective(&outs, &ins, &mut sets)?;
        for (output, flat) in outputs.iter().zip(&outs) {
            if !output.is_contiguous() {
                copy(output.shallow_clone(), &flat.f_view_as(output).map_err(|e| e.to_string())?)?;
            }
        }
        Ok(())
    }

    /// Each chunk of `total` elements (at most `most` a chunk): `start(at,
    /// count, set)` before the barrier, `finish` after it.
    fn chunked(
        &self,
        sets: &mut SlotSets,
        total: usize,
        most: usize,
        mut start: impl FnMut(usize, usize, usize) -> Result<(), String>,
        mut finish: impl FnMut(usize, usize, usize) -> Result<(), String>,
    ) -> Result<(), String> {
        let mut at = 0;
        while at < total {
            let (count, set) = (most.min(total - at), sets.next());
            start(at, count, set)?;
            self.barrier()?;
            finish(at, count, set)?;
            at += count;
        }
        Ok(())
    }

    /// A collective in place on `tensor`, chunk by chunk: `start(chunk,
    /// set)` before the barrier, `finish(chunk, set)` after it.
    fn in_place(&self, tensor: &Tensor, start: impl Fn(&Tensor, usize) -> Result<(), String>, finish: impl Fn(&Tensor, usize) -> Result<(), String>) -> Result<(), String> {
        self.issue(&[tensor], &[], |outs, _, sets| {
            let data = &outs[0];
            let chunk = |at: usize, count: usize| data.narrow(0, at as i64, count as i64);
            self.chunked(sets, data.numel(), Self::chunk_elements(data.kind()), |at, count, set| start(&chunk(at, count), set), |at, count, set| finish(&chunk(at, count), set))
        })
    }

    /// In place: every member's `tensor` becomes the reduction of all members'.
    pub(crate) fn all_reduce(&self, tensor: &Tensor, reduction: Reduction) -> Result<(), String> {
        let kind = tensor.kind();
        self.in_place(
            tensor,
            |chunk, set| copy(self.slot(set, self.rank, 0, chunk.numel(), kind), chunk),
            |chunk, set| self.reduce(chunk, (0..self.size).map(|member| self.slot(set, member, 0, chunk.numel(), kind)), reduction),
        )
    }

    /// `output` (members × input's length) receives every member's `input`, in group-rank order.
    pub(crate) fn all_gather_into_tensor(&self, output: &Tensor, input: &Tensor) -> Result<(), String> {
        self.issue(&[output], &[input], |outs, ins, sets| {
            let (output, input) = (&outs[0], &ins[0]);
            let (kind, total) = (input.kind(), input.numel());
            if output.numel() != total * self.size {
                return Err(format!("all_gather: an output of {} elements for {} members' {total}", output.numel(), self.size));
            }
            self.chunked(
                sets,
                total,
                Self::chunk_elements(kind),
                |at, count, set| copy(self.slot(set, self.rank, 0, count, kind), &input.narrow(0, at as i64, count as i64)),
                |at, count, set| (0..self.size).try_for_each(|member| copy(output.narrow(0, (member * total + at) as i64, count as i64), &self.slot(set, member, 0, count, kind))),
            )
        })
    }

    /// `output` receives this member's chunk of the reduction of every member's `input` (members × output's length).
    pub(crate) fn reduce_scatter_tensor(&self, output: &Tensor, input: &Tensor, reduction: Reduction) -> Result<(), String> {
        self.issue(&[output], &[input], |outs, ins, sets| {
            let (output, input) = (&outs[0], &ins[0]);
            let (kind, total) = (input.kind(), output.numel());
            if input.numel() != total * self.size {
                return Err(format!("reduce_scatter: an input of {} elements for {} members' {total}", input.numel(), self.size));
            }
            // Each member's slot holds, for every member, that member's piece of this chunk.
            let most = Self::chunk_elements(kind) / self.size;
            self.chunked(
                sets,
                total,
                most,
                |at, count, set| (0..self.size).try_for_each(|member| copy(self.slot(set, self.rank, member * count, count, kind), &input.narrow(0, (member * total + at) as i64, count as i64))),
                |at, count, set| {
                    let mine = output.narrow(0, at as i64, count as i64);
                    self.reduce(&mine, (0..self.size).map(|member| self.slot(set, member, self.rank * count, count, kind)), reduction)
                },
            )
        })
    }

    /// Every member's `tensor` becomes the group-rank `root`'s.
    pub(crate) fn broadcast(&self, tensor: &Tensor, root: usize) -> Result<(), String> {
        if root >= self.size {
            return Err(format!("broadcast from group rank {root} in a group of {}", self.size));
        }
        let (kind, sends) = (tensor.kind(), self.rank == root);
        self.in_place(
            tensor,
            |chunk, set| if sends { copy(self.slot(set, root, 0, chunk.numel(), kind), chunk) } else { Ok(()) },
            |chunk, set| if sends { Ok(()) } else { copy(chunk.shallow_clone(), &self.slot(set, root, 0, chunk.numel(), kind)) },
        )
    }

    pub(crate) fn barrier_all(&self) -> Result<(), String> {
        let _one_at_a_time = self.issuing.lock().unwrap_or_else(|e| e.into_inner());
        self.barrier()
    }
}

/// Which of the two slot sets a chunk uses: they take turns, so that a
/// member writing the next chunk never overwrites slots a slower member is
/// still reading (it reached this chunk's barrier only after the reads of
/// the chunk before the last), and each chunk needs one barrier.
#[derive(Default)]
struct SlotSets(u64);

impl SlotSets {
    fn next(&mut self) -> usize {
        self.0 += 1;
        (self.0 % 2) as usize
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `size` members as threads of this process, each with its own mapping of one segment.
    fn members(size: usize) -> Vec<SharedMemory> {
        let name = format!("ft-test-{}-{size}", std::process::id());
        let timeout = Duration::from_secs(60);
        let mut all = vec![SharedMemory::map(&name, 0, size, timeout, true).expect("/dev/shm is writable")];
        all.extend((1..size).map(|rank| SharedMemory::map(&name, rank, size, timeout, false).unwrap()));
        std::fs::remove_file(segment_path(&name)).unwrap();
        all
    }

    fn equal(a: &Tensor, b: &Tensor) -> bool {
        a.size() == b.size() && a.equal(b)
    }

    /// Tensors of more than two slots (so chunks, a short last one) and odd
    /// sizes, at 2 and 3 members: each collective's values as defined.
    #[test]
    fn collectives_in_several_chunks_give_every_member_the_expected_values() {
        for size in [2usize, 3] {
            let members = members(size);
            let n = 2 * SharedMemory::chunk_elements(Kind::Float) as i64 + 12_345;
            let sum_of_ranks = (size * (size - 1) / 2) as f64;
            std::thread::scope(|scope| {
                for memory in &members {
                    scope.spawn(move || {
                        let rank = memory.rank as f64;
                        let ramp = Tensor::arange(n, (Kind::Float, Device::Cpu));
                        let mine = &ramp + rank;
                        let summed = mine.copy();
                        memory.all_reduce(&summed, Reduction::Sum).unwrap();
                        assert!(equal(&summed, &(&ramp * size as f64 + sum_of_ranks)), "sum at {size}");
                        let largest = mine.copy();
                        memory.all_reduce(&largest, Reduction::Max).unwrap();
                        assert!(equal(&largest, &(&ramp + (size - 1) as f64)), "max at {size}");
                        let smallest = mine.copy();
                        memory.all_reduce(&smallest, Reduction::Min).unwrap();
                        assert!(equal(&smallest, &ramp), "min at {size}");
                        let average = mine.copy();
                        memory.all_reduce(&average, Reduction::Avg).unwrap();
                        assert!(equal(&average, &(&ramp + sum_of_ranks / size as f64)), "avg at {size}");
                        // In place into a view that is not contiguous.
                        let square = Tensor::arange(1001 * 1001, (Kind::Float, Device::Cpu)).view([1001, 1001]) + rank;
                        let transposed = square.tr();
                        memory.all_reduce(&transposed, Reduction::Sum).unwrap();
                        let expected = Tensor::arange(1001 * 1001, (Kind::Float, Device::Cpu)).view([1001, 1001]) * size as f64 + sum_of_ranks;
                        assert!(equal(&square, &expected), "a transposed view at {size}");
                        // Every member's part, in group-rank order.
                        let gathered = Tensor::zeros([n * size as i64], (Kind::Int64, Device::Cpu));
                        let part = Tensor::arange(n, (Kind::Int64, Device::Cpu)) + memory.rank as i64 * n;
                        memory.all_gather_into_tensor(&gathered, &part).unwrap();
                        assert!(equal(&gathered, &Tensor::arange(n * size as i64, (Kind::Int64, Device::Cpu))), "gather at {size}");
                        // This member's chunk of the sum.
                        let whole = Tensor::arange(n * size as i64, (Kind::Float, Device::Cpu)) + rank;
                        let chunk = Tensor::zeros([n], (Kind::Float, Device::Cpu));
                        memory.reduce_scatter_tensor(&chunk, &whole, Reduction::Sum).unwrap();
                        let expected = (Tensor::arange(n, (Kind::Float, Device::Cpu)) + (memory.rank as i64 * n) as f64) * size as f64 + sum_of_ranks;
                        assert!(equal(&chunk, &expected), "reduce-scatter at {size}");
                        // The last member's tensor, in bf16.
                        let sent = (Tensor::arange(n, (Kind::Float, Device::Cpu)) + rank).to_kind(Kind::BFloat16);
                        memory.broadcast(&sent, size - 1).unwrap();
                        let expected = (Tensor::arange(n, (Kind::Float, Device::Cpu)) + (size - 1) as f64).to_kind(Kind::BFloat16);
                        assert!(equal(&sent, &expected), "broadcast at {size}");
                        memory.barrier_all().unwrap();
                    });
                }
            });
        }
    }

    /// A member that never comes is a timeout naming the wait, and one whose
    /// process has ended is named within a peer check: neither is a hang.
    #[test]
    fn a_member_that_never_arrives_or_has_ended_is_an_error() {
        let alone = |peer: i32| {
            let name = format!("ft-test-{}-alone-{peer}", std::process::id());
            let memory = SharedMemory::map(&name, 0, 2, Duration::from_secs(1), true).unwrap();
            std::fs::remove_file(segment_path(&name)).unwrap();
            memory.pid(1).store(peer, Ordering::Release);
            memory.all_reduce(&Tensor::ones([4], (Kind::Float, Device::Cpu)), Reduction::Sum).unwrap_err()
        };
        let error = alone(std::process::id() as i32);
        assert!(error.contains("timed out after 1 s waiting for the group's other ranks in shared memory"), "{error}");
        let mut ended = std::process::Command::new("true").spawn().unwrap();
        ended.wait().unwrap();
        let error = alone(ended.id() as i32);
        assert!(error.contains(&format!("group rank 1 (process {}) ended while the others waited for it", ended.id())), "{error}");
    }
}
