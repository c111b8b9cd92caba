//! Training sequences ([`Row`]), their order (a seeded shuffle per epoch, [`Loader`]) and the
//! batches the step takes ([`batch_of`]).

use crate::model::Rng;
use crate::model::config::ModelError;
use crate::model::reference::{Batch, IGNORE_INDEX};

/// One training sequence as Hugging Face datasets hold it: `tokens` (`input_ids`) and one
/// label per token (`labels`: the token itself, or −100 where it is not trained on). The
/// model at position `t` is trained to predict `labels[t + 1]`, as transformers shifts them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Row {
    pub tokens: Vec<u32>,
    pub labels: Vec<i64>,
}

impl Row {
    /// A row trained on every token.
    pub fn all(tokens: Vec<u32>) -> Row {
        let labels = tokens.iter().map(|&t| t as i64).collect();
        Row { tokens, labels }
    }

    /// The positions the loss counts: labels after the first that are not −100.
    pub fn targets(&self) -> usize {
        self.labels
            .iter()
            .skip(1)
            .filter(|&&l| l != IGNORE_INDEX)
            .count()
    }
}

/// A batch of `rows` right-padded to `seq_len` (each at most that long): position `t` of a row
/// predicts its label `t + 1`, padding predicts nothing.
pub fn batch_of(rows: &[&Row], seq_len: usize) -> Result<Batch, ModelError> {
    let mut tokens = Vec::with_capacity(rows.len() * seq_len);
    let mut targets = Vec::with_capacity(rows.len() * seq_len);
    for (i, row) in rows.iter().enumerate() {
        let n = row.tokens.len();
        if n > seq_len || row.labels.len() != n {
            let expected = format!("at most {seq_len} tokens, one label each");
            let given = format!("{n} tokens, {} labels", row.labels.len());
            return Err(ModelError::invalid(
                "batch",
                format!("row {i}"),
                expected,
                given,
            ));
        }
        tokens.extend(&row.tokens);
        tokens.resize((i + 1) * seq_len, 0);
        targets.extend(row.labels.iter().skip(1));
        targets.resize((i + 1) * seq_len, IGNORE_INDEX);
    }
    Ok(Batch {
        batch: rows.len(),
        seq_len,
        tokens,
        targets,
        lens: rows.iter().map(|r| r.tokens.len()).collect(),
    })
}

/// Where a run is in its data: the epoch and the next row of that epoch's order.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Position {
    pub epoch: u64,
    pub next: usize,
}

/// The order rows are trained in: each epoch a new permutation drawn from the seed and the
/// epoch alone, so a run resumed at a [`Position`] takes the same rows as one that never
/// stopped.
#[derive(Clone, Debug)]
pub struct Loader {
    rows: usize,
    seed: u64,
    position: Position,
    order: Vec<usize>,
}

impl Loader {
    /// A loader over `rows` rows (at least one) at `position`.
    pub fn new(rows: usize, seed: u64, position: Position) -> Loader {
        let mut loader = Loader {
            rows,
            seed,
            position,
            order: vec![],
        };
        loader.order = loader.permutation(position.epoch);
        loader
    }

    /// The next `count` row indices, into the next epoch when this one runs out.
    pub fn take(&mut self, count: usize) -> Vec<usize> {
        let mut out = Vec::with_capacity(count);
        while out.len() < count {
            if self.position.next >= self.rows {
                self.position = Position {
                    epoch: self.position.epoch + 1,
                    next: 0,
                };
                self.order = self.permutation(self.position.epoch);
            }
            out.push(self.order[self.position.next]);
            self.position.next += 1;
        }
        out
    }

    pub fn position(&self) -> Position {
        self.position
    }

    /// Fisher–Yates with a generator seeded by the run's seed and the epoch.
    fn permutation(&self, epoch: u64) -> Vec<usize> {
        let mut rng = Rng::new(self.seed ^ epoch.wrapping_mul(0xD6E8_FEB8_6659_FD93));
        let mut order: Vec<usize> = (0..self.rows).collect();
        for i in (1..order.len()).rev() {
            order.swap(i, rng.below(i + 1));
        }
        order
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_batch_shifts_labels_and_pads() {
        let a = Row {
            tokens: vec![5, 6, 7],
            labels: vec![-100, 6, 7],
        };
        let b = Row::all(vec![9]);
        let batch = batch_of(&[&a, &b], 4).unwrap();
        assert_eq!(batch.tokens, [5, 6, 7, 0, 9, 0, 0, 0]);
        assert_eq!(batch.targets, [6, 7, -100, -100, -100, -100, -100, -100]);
        assert_eq!(batch.lens, [3, 1]);
        assert_eq!(a.targets(), 2);
        let long = Row::all(vec![1; 5]);
        assert!(
            batch_of(&[&long], 4)
                .unwrap_err()
                .to_string()
                .contains("row 0")
        );
    }

    #[test]
    fn every_epoch_is_a_permutation_and_a_resumed_loader_continues_the_same() {
        let mut loader = Loader::new(7, 3, Position { epoch: 0, next: 0 });
        let first: Vec<usize> = loader.take(7);
        let mut sorted = first.clone();
        sorted.sort();
        assert_eq!(sorted, (0..7).collect::<Vec<_>>());
        let second = loader.take(7);
        assert_ne!(first, second, "each epoch its own order");
        let mut straight = Loader::new(7, 3, Position { epoch: 0, next: 0 });
        let mut taken = straight.take(10);
        let mut resumed = Loader::new(7, 3, straight.position());
        taken.extend(resumed.take(8));
        let mut again = Loader::new(7, 3, Position { epoch: 0, next: 0 });
        assert_eq!(taken, again.take(18));
    }
}
