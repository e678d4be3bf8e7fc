//! One sync's commands in transaction order, and the steps a large full sync is split into.

use std::fmt;

use kp_core::model::IpFamily;

use super::Command;

/// The commands one service port writes: its chains (created, and emptied when they may hold
/// rules), then its affinity sets and rules.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct ServiceCommands {
    /// `add chain` (and `flush chain`) of each chain.
    pub(crate) chains: Vec<Command>,
    /// `add set` of each affinity set, then `add rule` of each rule.
    pub(crate) body: Vec<Command>,
    /// Whether these commands may go in a transaction of their own before the rest (see
    /// [`Transaction::steps`]): false when one of its affinity sets is re-created.
    pub(crate) alone: bool,
}

/// The commands of one sync, in the order of one atomic transaction: the fixed part and
/// stale chains (`head`), every rewritten service's chains, deleted affinity sets, every
/// service's sets and rules, then map elements and deleted chains (`tail`).
///
/// `Display` prints the `nft -f -` script (one statement a line); [`Transaction::commands`]
/// walks the same order without building text.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Transaction {
    pub(crate) family: IpFamily,
    /// Commands that let service commands run in transactions of their own before the rest
    /// (`add table`, `add chain mark-for-masquerade`); empty unless the sync is full.
    pub(crate) prelude: Vec<Command>,
    pub(crate) head: Vec<Command>,
    pub(crate) services: Vec<ServiceCommands>,
    pub(crate) deleted_sets: Vec<Command>,
    pub(crate) tail: Vec<Command>,
}

impl Transaction {
    /// `commands` as one transaction on `family`'s table (tests and tools build their own).
    pub fn new(family: IpFamily, commands: Vec<Command>) -> Self {
        Self {
            family,
            prelude: Vec::new(),
            head: commands,
            services: Vec::new(),
            deleted_sets: Vec::new(),
            tail: Vec::new(),
        }
    }

    /// Remove the table and everything in it; `add` first, so that an absent table is no
    /// error (`--cleanup`).
    pub fn remove_table(family: IpFamily) -> Self {
        Self::new(
            family,
            vec![Command::AddTable { comment: None }, Command::DeleteTable],
        )
    }

    /// The table's family.
    pub fn family(&self) -> IpFamily {
        self.family
    }

    /// Every command, in transaction order.
    pub fn commands(&self) -> impl Iterator<Item = &Command> + '_ {
        self.head
            .iter()
            .chain(self.services.iter().flat_map(|s| &s.chains))
            .chain(&self.deleted_sets)
            .chain(self.services.iter().flat_map(|s| &s.body))
            .chain(&self.tail)
    }

    /// How many commands (statements) there are.
    pub fn len(&self) -> usize {
        self.head.len()
            + self
                .services
                .iter()
                .map(|s| s.chains.len() + s.body.len())
                .sum::<usize>()
            + self.deleted_sets.len()
            + self.tail.len()
    }

    /// Whether there is nothing to do.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The same changes as a sequence of transactions of about `max_commands` commands each,
    /// to apply in order, so that no single transaction has to hold a whole large sync.
    ///
    /// Only a full sync is split (a partial one is a single step), and only in this safe
    /// order: first the services' own chains, affinity sets and rules, a group of whole
    /// services per step (each service's objects change atomically); nothing reaches them
    /// yet unless an element installed before already did, in which case the service is
    /// rewritten in one step, as in one transaction. The last step holds the rest in the
    /// order of one transaction: the fixed part (base chains, flushed and refilled maps),
    /// stale chains, the services that must stay there (one of their affinity sets is
    /// re-created), and the map elements that make the new chains reachable. If a step
    /// fails, the steps before it stay applied: the caller must then treat every chain as
    /// possibly holding rules ([`NftState::forget_chain_contents`](crate::nftables::NftState)).
    pub fn steps(&self, max_commands: usize) -> Vec<Vec<&Command>> {
        let alone = self.services.iter().filter(|s| s.alone).count();
        if self.prelude.is_empty() || alone == 0 || self.len() <= max_commands {
            return vec![self.commands().collect()];
        }
        let mut steps: Vec<Vec<&Command>> = vec![self.prelude.iter().collect()];
        for service in self.services.iter().filter(|s| s.alone) {
            let size = service.chains.len() + service.body.len();
            if steps
                .last()
                .is_some_and(|step| !step.is_empty() && step.len() + size > max_commands)
            {
                steps.push(Vec::new());
            }
            if let Some(step) = steps.last_mut() {
                step.extend(service.chains.iter().chain(&service.body));
            }
        }
        let rest = self.services.iter().filter(|s| !s.alone);
        let last: Vec<&Command> = self
            .head
            .iter()
            .chain(rest.clone().flat_map(|s| &s.chains))
            .chain(&self.deleted_sets)
            .chain(rest.flat_map(|s| &s.body))
            .chain(&self.tail)
            .collect();
        steps.push(last);
        steps
    }
}

/// Takes the steps of a full sync as [`render_in_steps`](crate::nftables::render_in_steps) renders
/// them, each to be applied as a kernel transaction of its own before the next is rendered,
/// so that a large full sync is never in memory as a whole.
pub trait StepSink {
    /// Why a step was not applied.
    type Error;

    /// At most this many commands per step (the `max_commands` of [`Transaction::steps`]).
    fn max_commands(&self) -> usize;

    /// Apply `commands` on `family`'s table as one transaction; on error nothing of it was
    /// applied (the steps before it stay).
    fn apply_step(&mut self, family: IpFamily, commands: &[Command]) -> Result<(), Self::Error>;
}

/// A [`StepSink`] that never takes a step: the whole transaction stays in the output.
#[derive(Clone, Copy, Debug, Default)]
pub struct NoSteps;

impl StepSink for NoSteps {
    type Error = std::convert::Infallible;

    fn max_commands(&self) -> usize {
        usize::MAX
    }

    fn apply_step(&mut self, _: IpFamily, _: &[Command]) -> Result<(), Self::Error> {
        Ok(())
    }
}

/// Groups the services of a full sync into the steps of [`Transaction::steps`] as they are
/// rendered, and hands each complete step to a [`StepSink`]: until the services alone exceed
/// one step, nothing is applied (a small sync stays one transaction); from then on only the
/// step being filled and the services that must stay in the last step are kept.
pub(crate) struct StepWriter<'s, S: StepSink + ?Sized> {
    sink: &'s mut S,
    family: IpFamily,
    max: usize,
    /// Empty unless the sync is full (only full syncs are split).
    prelude: Vec<Command>,
    /// Services not applied yet, in order: all of them until stepping starts, then only
    /// those that must stay in the last step.
    services: Vec<ServiceCommands>,
    /// Commands of the `alone` services in `services`, before stepping starts.
    alone_len: usize,
    /// The step being filled, once stepping has started.
    step: Option<Vec<Command>>,
    /// Steps applied.
    pub(crate) applied: usize,
    /// Commands of the transaction in the applied steps (the prelude's are repeated later).
    applied_commands: usize,
}

impl<'s, S: StepSink + ?Sized> StepWriter<'s, S> {
    /// Steps for `family`'s sync; `prelude` as in [`Transaction`].
    pub(crate) fn new(sink: &'s mut S, family: IpFamily, prelude: Vec<Command>) -> Self {
        Self {
            max: sink.max_commands(),
            sink,
            family,
            prelude,
            services: Vec::new(),
            alone_len: 0,
            step: None,
            applied: 0,
            applied_commands: 0,
        }
    }

    /// Add the next service's commands (in service order).
    pub(crate) fn push(&mut self, service: ServiceCommands) -> Result<(), S::Error> {
        if self.step.is_some() {
            if service.alone {
                return self.add_to_step(service);
            }
            self.services.push(service);
            return Ok(());
        }
        if service.alone {
            self.alone_len += service.chains.len() + service.body.len();
        }
        self.services.push(service);
        if self.prelude.is_empty()
            || self.alone_len == 0
            || self.prelude.len() + self.alone_len <= self.max
        {
            return Ok(());
        }
        // The transaction is larger than a step: start stepping, as `Transaction::steps`
        // would group the services seen so far.
        self.step = Some(self.prelude.clone());
        let mut last = Vec::new();
        for service in std::mem::take(&mut self.services) {
            if service.alone {
                self.add_to_step(service)?;
            } else {
                last.push(service);
            }
        }
        self.services = last;
        Ok(())
    }

    /// Put `service` into the current step, applying that step first if it is full.
    fn add_to_step(&mut self, service: ServiceCommands) -> Result<(), S::Error> {
        let size = service.chains.len() + service.body.len();
        let full = self
            .step
            .as_ref()
            .is_some_and(|step| !step.is_empty() && step.len() + size > self.max);
        if full {
            self.apply_step()?;
        }
        if let Some(step) = self.step.as_mut() {
            step.extend(service.chains);
            step.extend(service.body);
        }
        Ok(())
    }

    /// Apply the step being filled, if it holds anything.
    fn apply_step(&mut self) -> Result<(), S::Error> {
        let Some(step) = self.step.as_mut() else {
            return Ok(());
        };
        if step.is_empty() {
            return Ok(());
        }
        self.sink.apply_step(self.family, step)?;
        self.applied += 1;
        self.applied_commands += step.len();
        step.clear();
        Ok(())
    }

    /// The rest of the sync: once stepping started, the step being filled is applied and
    /// the transaction returned is the last step (no prelude, so it is not split again);
    /// otherwise the whole transaction. Also returns how many steps and commands were
    /// applied.
    pub(crate) fn finish(
        mut self,
        head: Vec<Command>,
        deleted_sets: Vec<Command>,
        tail: Vec<Command>,
    ) -> Result<(Transaction, usize, usize), S::Error> {
        let (prelude, repeated) = if self.step.is_some() {
            self.apply_step()?;
            (Vec::new(), self.prelude.len())
        } else {
            (self.prelude, 0)
        };
        let transaction = Transaction {
            family: self.family,
            prelude,
            head,
            services: self.services,
            deleted_sets,
            tail,
        };
        Ok((
            transaction,
            self.applied,
            self.applied_commands.saturating_sub(repeated),
        ))
    }
}

impl fmt::Display for Transaction {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for command in self.commands() {
            writeln!(f, "{}", command.display(self.family))?;
        }
        Ok(())
    }
}
