//! Expert parallelism (`train.expert_parallel`): the ranks of each expert
//! group of N consecutive ranks split a mixture of experts' experts, each
//! holding E/N of every sparse layer whole (its rows of the layer's
//! experts units, `model::Stage::experts`); tokens travel to the rank
//! holding their expert and back by all-to-all through the run's
//! communication hook (`CommHook::all_to_all`), as one autograd node each
//! way (`ft_sys::exchange`), whose backward is the reverse exchange. The
//! ranks holding the same experts in the other groups are its replicas,
//! over which the experts' gradients are all-reduced (`train/reduce.rs`).

use crate::distributed::comm::{Communicator, ProcessGroup};
use crate::distributed::comm_hook::{CommHook, TokenExchange};
use crate::model::ExpertExchange;
use anyhow::Result;
use std::cell::RefCell;
use std::rc::Rc;
use tch::Tensor;

/// The run's communication hook, shared by the trainer and its token exchanges.
pub type SharedHook = Rc<RefCell<Box<dyn CommHook>>>;

/// This rank's expert group and the replicas of its experts.
pub struct ExpertGroups {
    pub group: ProcessGroup,
    /// None when one group spans the world: each expert has no other copy.
    pub replicas: Option<ProcessGroup>,
}

impl ExpertGroups {
    /// Groups of `degree` consecutive ranks over `comm`'s world (collective).
    pub fn new(comm: &Communicator, degree: usize) -> Result<ExpertGroups> {
        let (group, replicas) = comm.blocks_and_strides(degree, ["expert", "expert_replica"])?;
        let replicas = (replicas.size() > 1).then_some(replicas);
        Ok(ExpertGroups { group, replicas })
    }

    /// Rows `range` of an experts unit of `experts` rows: this rank's.
    pub fn rows(&self, experts: i64) -> std::ops::Range<i64> {
        let per_rank = experts / self.group.size() as i64;
        let start = per_rank * self.group.rank() as i64;
        start..start + per_rank
    }
}

/// A block's token exchanges over an expert group, through the hook.
pub struct TokenExchanger {
    pub group: ProcessGroup,
    pub hook: SharedHook,
}

impl ExpertExchange for TokenExchanger {
    fn rank(&self) -> usize {
        self.group.rank()
    }

    fn size(&self) -> usize {
        self.group.size()
    }

    fn exchange(&self, rows: &Tensor, sent: &[i64], received: &[i64]) -> Result<Tensor> {
        let exchange = Exchange { group: self.group.clone(), hook: self.hook.clone(), sent: sent.to_vec(), received: received.to_vec() };
        ft_sys::exchange(rows, Box::new(exchange)).map_err(|e| anyhow::anyhow!(e.0))
    }
}

/// One exchange's splits, for its forward and its backward.
struct Exchange {
    group: ProcessGroup,
    hook: SharedHook,
    sent: Vec<i64>,
    received: Vec<i64>,
}

impl ft_sys::Exchanger for Exchange {
    fn exchange(&self, input: &Tensor, reverse: bool) -> Result<Tensor, String> {
        let (input_splits, output_splits) = match reverse {
            false => (self.sent.clone(), self.received.clone()),
            true => (self.received.clone(), self.sent.clone()),
        };
        let mut shape = input.size();
        shape[0] = output_splits.iter().sum();
        // Memory can run out here, at a step's peak: an error, not a panic.
        let output = Tensor::f_empty(shape.as_slice(), (input.kind(), input.device())).map_err(|e| format!("an expert-parallel token exchange: {e}"))?;
        let request = TokenExchange { group: &self.group, input: input.contiguous(), output: output.shallow_clone(), input_splits, output_splits };
        // The trainer holds no borrow of the hook while a block computes or backward runs.
        let mut hook = self.hook.try_borrow_mut().map_err(|_| "the communication hook is busy elsewhere during a token exchange".to_string())?;
        let name = hook.name().to_string();
        hook.all_to_all(request).and_then(|pending| pending.wait()).map_err(|e| format!("comm `{name}`: an expert-parallel token exchange: {e:#}"))?;
        Ok(output)
    }
}
