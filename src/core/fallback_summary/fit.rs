//! Fitting the budget: which lines and identifiers are chosen, measured
//! with the real tokenizer, and the cut to size when not even the
//! structure fits.

use super::*;

pub(super) fn line_cost(line: &str) -> u64 {
    tokens(line) + 1
}

/// Renders the sections and identifiers within `budget` tokens, or `None`
/// when not even the header fits.
pub(super) fn render_within(
    notes: &Notes,
    ids: &[String],
    header: &str,
    budget: u64,
) -> Option<String> {
    let mut room = budget;
    // The per-line estimate (each line counted alone, plus its newline) can
    // differ from the count of the joined text by a few tokens; shrink and
    // retry on the rare overshoot.
    for _ in 0..4 {
        let text = render_once(notes, ids, header, room)?;
        // Kept: its record counts the summary again (`sweep`).
        let used = count_text_kept(ENCODING, &text);
        if used <= budget {
            return Some(text);
        }
        room = room.checked_sub(used - budget + 8)?;
    }
    None
}

/// The heading of the identifier list.
pub(super) const IDS_HEADING: &str = "## Exact identifiers";

pub(super) struct Chosen {
    /// Per group: indices into its lines, and whether the short form is
    /// the one chosen.
    pub(super) lines: Vec<BTreeMap<usize, bool>>,
    pub(super) ids: Vec<usize>,
}

pub(super) fn render_once(
    notes: &Notes,
    ids: &[String],
    header: &str,
    budget: u64,
) -> Option<String> {
    let header_cost = line_cost(header);
    if header_cost > budget {
        return None;
    }
    let room = budget - header_cost;
    let groups = notes.groups();
    let costs: Vec<Vec<(u64, Option<u64>)>> = groups
        .iter()
        .map(|g| {
            g.lines
                .iter()
                .map(|l| {
                    (
                        line_cost(&format!("- {}", l.text)),
                        l.short.as_deref().map(|s| line_cost(&format!("- {s}"))),
                    )
                })
                .collect()
        })
        .collect();
    let id_costs: Vec<u64> = ids.iter().map(|id| line_cost(id)).collect();
    let ids_heading = IDS_HEADING;
    let all_ids_cost: u64 = id_costs.iter().sum::<u64>() + line_cost(ids_heading);
    let reserve = all_ids_cost.min(room * IDENTIFIER_RESERVE_PERCENT / 100);
    let narrative_room = room - reserve;

    let mut chosen = Chosen {
        lines: vec![BTreeMap::new(); groups.len()],
        ids: Vec::new(),
    };
    let mut headings_paid: BTreeSet<SectionId> = BTreeSet::new();
    let mut used = 0u64;
    // First pass: each group up to its share of the narrative room.
    for (g, group) in groups.iter().enumerate() {
        let share = narrative_room * group.share / 100;
        used += fill_group(
            group,
            &costs[g],
            share,
            &mut chosen.lines[g],
            &mut headings_paid,
        );
    }
    // Then the rest of the narrative room, section by section in the
    // groups' order of importance.
    let mut left = narrative_room.saturating_sub(used);
    for (g, group) in groups.iter().enumerate() {
        let spent = fill_group(
            group,
            &costs[g],
            left,
            &mut chosen.lines[g],
            &mut headings_paid,
        );
        left = left.saturating_sub(spent);
        used += spent;
    }
    // Then the identifiers the narrative does not already quote.
    let narrative = render_text(header, &groups, &chosen, ids);
    let quoted = Trigrams::of(&narrative);
    let missing: Vec<usize> = (0..ids.len())
        .filter(|&i| !(quoted.may_hold(&ids[i]) && narrative.contains(ids[i].as_str())))
        .collect();
    let mut id_room = room.saturating_sub(used);
    let mut all_listed = missing.is_empty();
    if !missing.is_empty() && id_room > line_cost(ids_heading) {
        all_listed = true;
        id_room -= line_cost(ids_heading);
        let mut listed = String::new();
        let mut listed_runs = Trigrams::of("");
        for &i in &missing {
            // A suffix of a path already listed is quoted by it.
            if listed_runs.may_hold(&ids[i]) && listed.contains(ids[i].as_str()) {
                continue;
            }
            if id_costs[i] <= id_room {
                id_room -= id_costs[i];
                chosen.ids.push(i);
                listed.push_str(&ids[i]);
                listed.push('\n');
                listed_runs.push(&ids[i]);
                listed_runs.push("\n");
            } else {
                all_listed = false;
            }
        }
        used = room - id_room;
    }
    // Room left: more narrative, in section order; the identifier list is
    // then recomputed, and can only shrink.
    if all_listed {
        let mut left = room.saturating_sub(used);
        for (g, group) in groups.iter().enumerate() {
            let spent = fill_group(
                group,
                &costs[g],
                left,
                &mut chosen.lines[g],
                &mut headings_paid,
            );
            left = left.saturating_sub(spent);
        }
        let narrative = render_text(
            header,
            &groups,
            &Chosen {
                lines: chosen.lines.clone(),
                ids: Vec::new(),
            },
            ids,
        );
        chosen.ids = chosen
            .ids
            .iter()
            .copied()
            .filter(|&i| !narrative.contains(ids[i].as_str()))
            .collect();
    }
    Some(render_text(header, &groups, &chosen, ids))
}

/// The runs of three bytes a text holds, a bit each (hashed into a
/// table): a string holding a run the text lacks is not in it. A summary
/// weighs tens to hundreds of identifiers against its narrative and
/// against the ones it has listed (a text that grows with each), most of
/// them in neither, and searching those texts for each was a few percent
/// of `run`'s instructions under compaction; with the runs noted, only an
/// identifier whose runs are all there (or that is too short to have one)
/// is searched for. Pairs of bytes were too few to tell paths apart: the
/// paths of one project share most of theirs.
pub(super) struct Trigrams {
    bits: Vec<u64>,
    /// The text's last two bytes, the start of the next run.
    tail: [Option<u8>; 2],
}

/// The table's size, in bits (8 KiB): a narrative of a few KiB leaves
/// most of it clear, and a long list of identifiers still much of it.
const TRIGRAM_BITS: u32 = 16;

impl Trigrams {
    pub(super) fn of(text: &str) -> Trigrams {
        let mut trigrams = Trigrams {
            bits: vec![0; (1 << TRIGRAM_BITS) / 64],
            tail: [None, None],
        };
        trigrams.push(text);
        trigrams
    }

    /// Notes the runs of `more`, appended to the text.
    pub(super) fn push(&mut self, more: &str) {
        for &c in more.as_bytes() {
            if let [Some(a), Some(b)] = self.tail {
                let i = Self::index(a, b, c);
                self.bits[i / 64] |= 1 << (i % 64);
            }
            self.tail = [self.tail[1], Some(c)];
        }
    }

    /// `false` when `s` is surely not in the text (`text.contains(s)`
    /// answers the rest).
    pub(super) fn may_hold(&self, s: &str) -> bool {
        s.as_bytes().windows(3).all(|w| {
            let i = Self::index(w[0], w[1], w[2]);
            self.bits[i / 64] & (1 << (i % 64)) != 0
        })
    }

    fn index(a: u8, b: u8, c: u8) -> usize {
        let run = (u32::from(a) << 16) | (u32::from(b) << 8) | u32::from(c);
        // Fibonacci hashing: the product's top bits.
        (run.wrapping_mul(0x9E37_79B1) >> (32 - TRIGRAM_BITS)) as usize
    }
}

/// Adds lines of `group` in its keep order while they fit `room` (a line
/// too long for it in its short form, when it has one); returns the tokens
/// spent (a section heading is paid by its first line).
pub(super) fn fill_group(
    group: &Group,
    costs: &[(u64, Option<u64>)],
    room: u64,
    chosen: &mut BTreeMap<usize, bool>,
    headings_paid: &mut BTreeSet<SectionId>,
) -> u64 {
    let heading_cost = line_cost(group.section.heading());
    let mut spent = 0u64;
    for i in keep_order(group.keep, group.lines.len()) {
        let extra = if headings_paid.contains(&group.section) {
            0
        } else {
            heading_cost
        };
        let (long, short) = costs[i];
        match chosen.get(&i) {
            // Taken short: the long form if the room has grown for it.
            Some(true) => {
                if spent + long.saturating_sub(short.unwrap_or(long)) <= room {
                    spent += long.saturating_sub(short.unwrap_or(long));
                    chosen.insert(i, false);
                }
                continue;
            }
            Some(false) => continue,
            None => {}
        }
        if spent + long + extra <= room {
            spent += long + extra;
            headings_paid.insert(group.section);
            chosen.insert(i, false);
        } else if let Some(short) = short.filter(|s| spent + s + extra <= room) {
            spent += short + extra;
            headings_paid.insert(group.section);
            chosen.insert(i, true);
        }
    }
    spent
}

pub(super) fn keep_order(keep: Keep, n: usize) -> Vec<usize> {
    match keep {
        Keep::Newest => (0..n).rev().collect(),
        Keep::Ends => {
            let mut order = Vec::with_capacity(n);
            let (mut lo, mut hi) = (0usize, n);
            while lo < hi {
                order.push(lo);
                lo += 1;
                if lo < hi {
                    hi -= 1;
                    order.push(hi);
                }
            }
            order
        }
    }
}

pub(super) fn render_text(
    header: &str,
    groups: &[Group],
    chosen: &Chosen,
    ids: &[String],
) -> String {
    let mut out = String::from(header);
    for section in SectionId::ALL {
        // Lines of every group of this section, in source order.
        let mut lines: Vec<(usize, usize, &str)> = Vec::new();
        for (g, group) in groups.iter().enumerate() {
            if group.section != section {
                continue;
            }
            for (&i, &short) in &chosen.lines[g] {
                let line = &group.lines[i];
                let text = if short {
                    line.short.as_deref().unwrap_or(&line.text)
                } else {
                    &line.text
                };
                lines.push((line.at, i, text));
            }
        }
        if lines.is_empty() {
            continue;
        }
        lines.sort_by_key(|&(at, i, _)| (at, i));
        out.push('\n');
        out.push_str(section.heading());
        for (_, _, line) in lines {
            out.push_str("\n- ");
            out.push_str(line);
        }
    }
    if !chosen.ids.is_empty() {
        out.push('\n');
        out.push_str(IDS_HEADING);
        for &i in &chosen.ids {
            out.push('\n');
            out.push_str(&ids[i]);
        }
    }
    out
}

/// The longest prefix of `text` (cut on a char boundary, preferably at a
/// line or word end) that is at most `budget` tokens.
pub(super) fn truncate_to_tokens(text: &str, budget: u64) -> String {
    if tokens(text) <= budget {
        return text.to_string();
    }
    // Token counts of prefixes grow with the prefix.
    let end = crate::core::tokens::longest_prefix(text, |end| tokens(&text[..end]) <= budget);
    let cut = &text[..end];
    // Prefer ending at whitespace if one is close: a half word is noise.
    // BPE counts are not monotonic in the prefix, so the shorter cut is
    // measured again.
    match cut.rfind(char::is_whitespace) {
        Some(at) if cut.len() - at <= 40 && at > 0 => {
            let shorter = cut[..at].trim_end();
            if tokens(shorter) <= budget {
                shorter.to_string()
            } else {
                cut.to_string()
            }
        }
        _ => cut.to_string(),
    }
}
