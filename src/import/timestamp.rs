//! Source timestamps to event time (milliseconds since the Unix epoch).
//!
//! Transcripts write times as RFC 3339 (`2026-02-10T21:11:56.846Z`), as
//! ISO 8601 without a zone (OpenHands: `2025-02-01T00:14:10.787622`), or as
//! `YYYY-MM-DD HH:MM:SS` (aider). A time without a zone is read as UTC: the
//! source does not say which zone it meant, and UTC keeps the result the same
//! on every machine.

/// Parses an ISO 8601 / RFC 3339 date-time into milliseconds since the epoch.
/// Returns `None` for anything it does not fully understand or before 1970.
pub(crate) fn parse_iso8601(text: &str) -> Option<u64> {
    let s = text.trim().as_bytes();
    let year = digits(s, 0, 4)? as i64;
    if s.get(4) != Some(&b'-') || s.get(7) != Some(&b'-') {
        return None;
    }
    let month = digits(s, 5, 2)?;
    let day = digits(s, 8, 2)?;
    if !matches!(s.get(10), Some(b'T' | b't' | b' ')) {
        return None;
    }
    let hour = digits(s, 11, 2)? as i64;
    if s.get(13) != Some(&b':') {
        return None;
    }
    let minute = digits(s, 14, 2)? as i64;
    // Seconds are optional in ISO 8601 (`HH:MM`).
    let (second, mut pos) = if s.get(16) == Some(&b':') {
        (digits(s, 17, 2)? as i64, 19)
    } else {
        (0, 16)
    };
    let mut millis = 0i64;
    if matches!(s.get(pos), Some(b'.' | b',')) {
        pos += 1;
        let start = pos;
        while pos < s.len() && s[pos].is_ascii_digit() {
            if pos - start < 3 {
                millis = millis * 10 + i64::from(s[pos] - b'0');
            }
            pos += 1;
        }
        let read = pos - start;
        if read == 0 {
            return None;
        }
        for _ in read..3 {
            millis *= 10;
        }
    }
    let offset_minutes: i64 = match s.get(pos) {
        None => 0,
        Some(b'Z' | b'z') if pos + 1 == s.len() => 0,
        Some(sign @ (b'+' | b'-')) => {
            let h = digits(s, pos + 1, 2)? as i64;
            let m_at = if s.get(pos + 3) == Some(&b':') {
                pos + 4
            } else {
                pos + 3
            };
            let m = digits(s, m_at, 2)? as i64;
            if m_at + 2 != s.len() {
                return None;
            }
            let total = h * 60 + m;
            if *sign == b'-' {
                -total
            } else {
                total
            }
        }
        _ => return None,
    };
    if !(1..=12).contains(&month)
        || day == 0
        || day > days_in_month(year, month)
        || hour > 23
        || minute > 59
        || second > 60
    {
        return None;
    }
    let days = days_from_civil(year, month, day);
    let secs = days * 86_400 + hour * 3600 + minute * 60 + second - offset_minutes * 60;
    let ms = secs.checked_mul(1000)?.checked_add(millis)?;
    u64::try_from(ms).ok()
}

fn digits(s: &[u8], at: usize, len: usize) -> Option<u32> {
    let slice = s.get(at..at + len)?;
    let mut v = 0u32;
    for b in slice {
        if !b.is_ascii_digit() {
            return None;
        }
        v = v * 10 + u32::from(b - b'0');
    }
    Some(v)
}

fn is_leap(year: i64) -> bool {
    (year % 4 == 0 && year % 100 != 0) || year % 400 == 0
}

fn days_in_month(year: i64, month: u32) -> u32 {
    match month {
        2 if is_leap(year) => 29,
        2 => 28,
        4 | 6 | 9 | 11 => 30,
        _ => 31,
    }
}

/// Days since 1970-01-01 of a proleptic Gregorian date (Howard Hinnant's
/// algorithm), so no date library is needed for this one conversion.
fn days_from_civil(year: i64, month: u32, day: u32) -> i64 {
    let y = if month <= 2 { year - 1 } else { year };
    let era = if y >= 0 { y } else { y - 399 } / 400;
    let yoe = y - era * 400;
    let m = i64::from(month);
    let doy = (153 * (if m > 2 { m - 3 } else { m + 9 }) + 2) / 5 + i64::from(day) - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rfc3339_with_zone_and_fraction() {
        // 2026-02-10T21:11:56.846Z, checked with `date -u -d ... +%s%3N`.
        assert_eq!(
            parse_iso8601("2026-02-10T21:11:56.846Z"),
            Some(1_770_757_916_846)
        );
        assert_eq!(parse_iso8601("1970-01-01T00:00:00Z"), Some(0));
        assert_eq!(
            parse_iso8601("1970-01-01T01:00:00+01:00"),
            Some(0),
            "offsets are subtracted"
        );
        assert_eq!(parse_iso8601("1970-01-01T00:00:00-0130"), Some(5_400_000));
    }

    #[test]
    fn zoneless_and_space_separated_read_as_utc() {
        assert_eq!(
            parse_iso8601("2025-02-01T00:14:10.787622"),
            Some(1_738_368_850_787)
        );
        assert_eq!(
            parse_iso8601("2024-08-05 19:33:02"),
            Some(1_722_886_382_000)
        );
        assert_eq!(parse_iso8601("2024-02-29 00:00"), Some(1_709_164_800_000));
    }

    #[test]
    fn rejects_what_it_does_not_understand() {
        for bad in [
            "",
            "yesterday",
            "2024-13-01T00:00:00Z",
            "2023-02-29T00:00:00Z",
            "2024-01-01T25:00:00Z",
            "2024-01-01T00:00:00Zjunk",
            "1969-12-31T23:59:59Z",
            "2024-01-01T00:00:00.",
        ] {
            assert_eq!(parse_iso8601(bad), None, "{bad}");
        }
    }
}
