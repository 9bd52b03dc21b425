//! What the agent would see now: the ordered context items, their token
//! and byte sums, and how often the list changed other than by appending.
//!
//! The four move together or the state is wrong: assembly budgets by the
//! token sum, the transcript-bytes trigger by the byte sum, and the state
//! store writes only appended items while the edit count stays the same
//! (the whole list otherwise). So they are private, and changed only by
//! [`ContextWindow::push`], [`ContextWindow::replace`] and
//! [`ContextWindow::clear`]; readers see the items as a slice.

use super::ContextItem;
use serde::{Deserialize, Serialize};
use std::ops::{Deref, Range};

/// The context items of a conversation with their sums (module doc).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ContextWindow {
    items: Vec<ContextItem>,
    /// Sum of the items' tokens in context.
    tokens: u64,
    /// Bytes of the raw turns among the items.
    bytes: u64,
    #[serde(skip)]
    edits: ContextEdits,
}

/// How many times the items changed other than by appending.
/// Bookkeeping, not state: not serialized, hashed or compared.
#[derive(Debug, Clone, Copy, Default)]
struct ContextEdits(u64);

impl PartialEq for ContextEdits {
    fn eq(&self, _: &ContextEdits) -> bool {
        true
    }
}

impl Deref for ContextWindow {
    type Target = [ContextItem];
    fn deref(&self) -> &[ContextItem] {
        &self.items
    }
}

impl<'a> IntoIterator for &'a ContextWindow {
    type Item = &'a ContextItem;
    type IntoIter = std::slice::Iter<'a, ContextItem>;
    fn into_iter(self) -> Self::IntoIter {
        self.items.iter()
    }
}

impl ContextWindow {
    /// Tokens of everything in context.
    pub fn tokens(&self) -> u64 {
        self.tokens
    }

    /// Bytes of the raw turns in context.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Changes other than appends so far (see the module doc).
    pub fn edits(&self) -> u64 {
        self.edits.0
    }

    /// Appends an item costing `tokens` in context (and `bytes`, for a
    /// raw turn).
    pub fn push(&mut self, item: ContextItem, tokens: u64, bytes: u64) {
        self.items.push(item);
        self.tokens += tokens;
        self.bytes += bytes;
    }

    /// Puts `item` (costing `tokens`) in place of the items in `range`,
    /// which cost `removed_tokens` and held `removed_bytes` of raw turns.
    pub fn replace(
        &mut self,
        range: Range<usize>,
        item: ContextItem,
        tokens: u64,
        removed_tokens: u64,
        removed_bytes: u64,
    ) {
        self.items.splice(range, [item]);
        self.tokens = self.tokens - removed_tokens + tokens;
        self.bytes -= removed_bytes;
        self.edits.0 = self.edits.0.wrapping_add(1);
    }

    /// Empties the context (a reset).
    pub fn clear(&mut self) {
        self.items.clear();
        self.tokens = 0;
        self.bytes = 0;
        self.edits.0 = self.edits.0.wrapping_add(1);
    }

    /// The items alone, taken out while the sums stay (the state store
    /// writes the items in chunks apart from a conversation's head).
    pub(crate) fn take_items(&mut self) -> Vec<ContextItem> {
        std::mem::take(&mut self.items)
    }

    /// Puts back items taken by [`ContextWindow::take_items`] or read
    /// from the store's chunks (whose head kept the sums).
    pub(crate) fn restore_items(&mut self, items: Vec<ContextItem>) {
        self.items = items;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sums_follow_the_items_and_only_non_appends_count_as_edits() {
        let mut w = ContextWindow::default();
        w.push(ContextItem::Turn(0), 10, 40);
        w.push(ContextItem::Turn(1), 20, 80);
        w.push(ContextItem::Turn(2), 5, 20);
        assert_eq!((w.tokens(), w.bytes(), w.edits()), (35, 140, 0));
        w.replace(0..2, ContextItem::Summary(0), 7, 30, 120);
        assert_eq!(&*w, &[ContextItem::Summary(0), ContextItem::Turn(2)]);
        assert_eq!((w.tokens(), w.bytes(), w.edits()), (12, 20, 1));
        w.clear();
        assert!(w.is_empty());
        assert_eq!((w.tokens(), w.bytes(), w.edits()), (0, 0, 2));
    }

    #[test]
    fn the_edit_count_is_not_state() {
        let mut a = ContextWindow::default();
        let b = ContextWindow::default();
        a.clear();
        assert_eq!(a, b, "compared without the edit count");
        assert_eq!(
            rmp_serde::to_vec(&a).unwrap(),
            rmp_serde::to_vec(&b).unwrap(),
            "and not serialized"
        );
    }
}
