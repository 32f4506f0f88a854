//! Every live buffer's page table, for the work that looks across buffers:
//! room-making's victims, the balancer's harvest.
#![forbid(unsafe_code)]

use std::sync::{Arc, Weak};

use parking_lot::Mutex;

use super::table::Table;

/// Weak references: a buffer dropped meanwhile gives its capacity back at
/// once, not after the pass that looked at it.
#[derive(Default)]
pub(crate) struct Registry {
    tables: Mutex<Vec<Weak<Table>>>,
}

impl Registry {
    /// Adds a new buffer's table.
    pub(crate) fn add(&self, table: &Arc<Table>) {
        let mut tables = self.tables.lock();
        // Amortized pruning of dropped buffers' entries.
        if tables.len() >= 64 && tables.len().is_power_of_two() {
            tables.retain(|t| t.strong_count() > 0);
        }
        tables.push(Arc::downgrade(table));
    }

    /// The live tables, pruned of dropped ones, to upgrade one at a time.
    pub(crate) fn weak(&self) -> Vec<Weak<Table>> {
        let mut list = self.tables.lock();
        list.retain(|t| t.strong_count() > 0);
        list.clone()
    }

    /// The live tables.
    pub(crate) fn live(&self) -> Vec<Arc<Table>> {
        self.tables
            .lock()
            .iter()
            .filter_map(Weak::upgrade)
            .collect()
    }
}
