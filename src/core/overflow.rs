//! The provider-error recognizer: does an error text mean "the request did
//! not fit the model's context window"?
//!
//! Only that kind of error is fixed by compaction, so only it may trigger an
//! urgent compaction. Errors that look alike but are cured by waiting, paying,
//! re-authenticating or asking differently (rate limits, tokens per minute,
//! quotas, throttling, overload, auth, unknown models, content filters,
//! timeouts, an output-length limit alone) must not. Nor must a size limit
//! on the request's bytes: an HTTP 413 from a proxy or gateway, a request
//! body, payload, upload or file over a limit in bytes (nginx's `413 Request
//! Entity Too Large`, Anthropic's `request_too_large`, OpenAI's `File is too
//! large.`, an API gateway's `HTTP content length exceeded 10485760 bytes.`).
//! Those are told apart ([`ErrorVerdict::size_limit`]) unless the text speaks
//! of tokens or the context, which only a context limit does.
//!
//! The recognizer reads the text for what it says, not for a provider's exact
//! wording: a context noun (window / length / size / limit) next to an excess
//! (exceeded, too long, ran out of room, only N tokens), or a request / prompt /
//! input that is too long or exceeds a maximum, in English or in the
//! Chinese that proxies use, JSON-wrapped or behind an HTTP status. Vetoes for
//! the look-alikes are checked first. One look-alike is an overflow after all:
//! a per-minute token limit that a single request exceeds on its own (Groq and
//! OpenAI say `Limit 8000, Requested 8098`); waiting can never admit it.
//!
//! Token counts stated in the text are extracted so the fold can use the
//! provider's own numbers (see [`ErrorVerdict`]).

use regex::Regex;
use std::collections::BTreeMap;
use std::sync::LazyLock;

/// What an error text says.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ErrorVerdict {
    /// The request did not fit the model's context window: compaction helps.
    pub overflow: bool,
    /// The request was refused for its size in bytes (an HTTP 413, a request
    /// body, payload, upload or file size limit of a provider, proxy or
    /// gateway), not for its tokens. Never an overflow: compaction is not the
    /// cure (a smaller attachment or a larger body limit is).
    pub size_limit: bool,
    /// The size of the request as the provider counted it against its limit:
    /// the prompt, plus the output reservation when the text adds the two
    /// (`156321 + 48384 > 200000`, TGI's `inputs` + `max_new_tokens`).
    /// Only filled for an overflow.
    pub requested_tokens: Option<u64>,
    /// The limit the request was measured against (the context window, or
    /// the per-request ceiling). Only filled for an overflow.
    pub limit_tokens: Option<u64>,
    /// Every token count the text states, in order of appearance (parts of
    /// a sum included). Only filled for an overflow.
    pub token_counts: Vec<u64>,
}

/// Reads a provider error text.
pub fn classify(text: &str) -> ErrorVerdict {
    let normalized = normalize(text);
    let overflow = is_overflow(&normalized);
    if !overflow {
        return ErrorVerdict {
            size_limit: is_size_limit(&normalized),
            ..ErrorVerdict::default()
        };
    }
    let counts = read_token_counts(&normalized);
    ErrorVerdict {
        overflow,
        size_limit: false,
        requested_tokens: counts.requested,
        limit_tokens: counts.limit,
        token_counts: counts.all,
    }
}

/// Lowercase, JSON `\uXXXX` and `\"` escapes decoded, thousands separators
/// dropped, `_` and backticks read as spaces (`context_length_exceeded`,
/// `` `max_new_tokens` ``), whitespace collapsed.
fn normalize(text: &str) -> String {
    let decoded = decode_json_escapes(text);
    let mut out = String::with_capacity(decoded.len());
    let chars: Vec<char> = decoded.chars().collect();
    let mut last_space = true;
    for (i, &c) in chars.iter().enumerate() {
        let c = match c {
            '_' | '`' => ' ',
            // 262,144 -> 262144 (but keep "8000, requested").
            ',' if i > 0
                && chars[i - 1].is_ascii_digit()
                && chars.get(i + 1).is_some_and(char::is_ascii_digit) =>
            {
                continue
            }
            c if c.is_whitespace() => ' ',
            c => c,
        };
        if c == ' ' {
            if !last_space {
                out.push(' ');
            }
            last_space = true;
        } else {
            out.extend(c.to_lowercase());
            last_space = false;
        }
    }
    out.trim_end().to_string()
}

/// Decodes the `\uXXXX` (with surrogate pairs), `\"`, `\n`, `\t` and `\\`
/// escapes a JSON-wrapped error carries when it was stringified twice.
fn decode_json_escapes(text: &str) -> String {
    if !text.contains('\\') {
        return text.to_string();
    }
    let mut out = String::with_capacity(text.len());
    let mut chars = text.chars().peekable();
    while let Some(c) = chars.next() {
        if c != '\\' {
            out.push(c);
            continue;
        }
        match chars.peek().copied() {
            Some('u') => {
                chars.next();
                let hex: String = chars.by_ref().take(4).collect();
                match u32::from_str_radix(&hex, 16) {
                    Ok(high @ 0xD800..=0xDBFF) => {
                        let mut rest = chars.clone();
                        let low = if rest.next() == Some('\\') && rest.next() == Some('u') {
                            let h: String = rest.by_ref().take(4).collect();
                            u32::from_str_radix(&h, 16).ok()
                        } else {
                            None
                        };
                        match low {
                            Some(low @ 0xDC00..=0xDFFF) => {
                                let code = 0x10000 + ((high - 0xD800) << 10) + (low - 0xDC00);
                                out.push(char::from_u32(code).unwrap_or('\u{FFFD}'));
                                chars = rest;
                            }
                            _ => out.push('\u{FFFD}'),
                        }
                    }
                    Ok(code) => out.push(char::from_u32(code).unwrap_or('\u{FFFD}')),
                    Err(_) => {
                        out.push_str("\\u");
                        out.push_str(&hex);
                    }
                }
            }
            Some('n') | Some('t') | Some('r') => {
                chars.next();
                out.push(' ');
            }
            Some(e @ ('"' | '\\' | '/')) => {
                chars.next();
                out.push(e);
            }
            _ => out.push('\\'),
        }
    }
    out
}

fn re(pattern: &str) -> Regex {
    match Regex::new(pattern) {
        Ok(regex) => regex,
        // The patterns are constants of this file: only a bug reaches this.
        Err(e) => panic!("overflow pattern does not compile: {e}"),
    }
}

/// The one look-alike that is an overflow: a per-minute token limit stated
/// with a single request larger than the whole limit. Both figures must be
/// tokens in one clause (`tokens per minute (TPM): Limit 8000, Requested 8098`).
static TPM_CEILING: LazyLock<Regex> = LazyLock::new(|| {
    re(
        r"(?:\btpm\b|tokens per min(?:ute)?\b)[^.;\n]*?\blimit:?\s*([0-9]+)[^.;\n]*?\brequested:?\s*([0-9]+)",
    )
});

/// Errors that compaction cannot fix, however they are worded.
static VETOES: LazyLock<Vec<Regex>> = LazyLock::new(|| {
    [
        // Rate limits, per-period token budgets, quotas, billing.
        r"rate ?limit|ratelimit|too many requests|\bthrottl|\bquota|usage limit|spend(?:ing)? limit|billing|credit balance|\bcredits?\b|\bafford\b|insufficient (?:quota|balance|funds|credits?)|payment required|\bper (?:second|minute|min|hour|day|month)\b|tokens? per (?:second|minute|min|hour|day)|\b(?:tpm|tpd|rpm|rpd|itpm|otpm)\b|\bresource exhausted\b|try again in [0-9.]+ ?(?:ms|s|sec|seconds|m|min|minutes|h|hours)\b|retry[- ]after|concurren(?:cy|t requests)|(?:daily|weekly|monthly) (?:limit|usage)|requests? (?:per|limit)",
        r"频率|频繁|限流|配额|额度|余额|每分钟|欠费",
        // HTTP 429 (Too Many Requests) in a status position.
        r#"^\s*(?:http\s*)?429\b|status(?: code)?\s*[:=]?\s*429\b|"(?:status|code)"\s*:\s*"?429\b|\(429\)|error\s*(?:code)?\s*:?\s*429\b"#,
        // Overload and transient server trouble.
        r"overloaded|\bat capacity\b|high demand|service unavailable|temporarily unavailable|\b529\b|过载|负载过高|繁忙",
        // Authentication and permission.
        r"api ?key|\bunauthori[sz]ed|unauthenticated|authentication|\bforbidden\b|permission denied|access denied|not authori[sz]ed|invalid (?:token|credentials)|must be verified|^\s*(?:http\s*)?40[13]\b|status(?: code)?\s*[:=]?\s*40[13]\b|认证|鉴权|无权|密钥",
        // Unknown or retired model.
        r"model(?: [^ ]+)? (?:is )?not found|model [^ ]+ does not exist|(?:does not|doesn't) exist|unknown model|no such model|model not found|invalid model|not a valid model|(?:deactivated|decommissioned|deprecated)|no endpoints found|模型不存在",
        // Content filters and safety systems.
        r"content (?:filter|management|policy)|safety (?:system|filter)|\bflagged\b|moderation|violat|敏感|违规",
        // Timeouts and connection failures ("context deadline exceeded" is Go's timeout).
        r"timed? ?out\b|timeout|deadline exceeded|\beconn(?:reset|refused|aborted)\b|\betimedout\b|socket hang up|connection (?:reset|refused|error|closed)|超时",
        // A model that cannot be loaded with that window at all (memory).
        r"out of memory|not enough memory|\bvram\b|failed to load|\boom\b|显存|内存不足",
        // Template / tool-pairing / format errors that only look like prompts.
        r"jinja|prompt template|tool (?:use|result|call) ids?|without (?:a )?(?:corresponding )?tool",
    ]
    .iter()
    .map(|p| re(p))
    .collect()
});

/// A limit on the request's size in bytes: HTTP 413 and its names, a body /
/// payload / upload / file size, a size in bytes. Only a size limit when the
/// text says nothing of tokens or the context ([`SPEAKS_OF_TOKENS`]).
static SIZE_LIMIT: LazyLock<Vec<Regex>> = LazyLock::new(|| {
    [
        // HTTP 413 in a status position, and its names (RFC 9110 "Content
        // Too Large", formerly "Payload Too Large", "Request Entity Too Large").
        r#"^\s*(?:http(?:/[0-9.]+)?\s*)?413\b|(?:http(?:/[0-9.]+)?|status(?: code)?|error(?: code)?)\s*[:=(]?\s*413\b|\(413\)|"(?:status|code)"\s*:\s*"?413\b|entity too large|payload too large|content too large|requestentitytoolarge|payloadtoolarge"#,
        // A size in bytes, and the body / payload / upload / file size words.
        r"\b[0-9]+(?:\.[0-9]+)? ?(?:bytes?|kb|mb|gb|kib|mib|gib)\b|\bbytes?\b|(?:request|payload|body|upload|file|attachment|content) (?:size|length)\b|\b(?:request|http) body\b|\bbody (?:size|limit|too large)|max(?:imum)? (?:allowed )?(?:request |body |payload |upload |file )?size\b|exceeds? the maximum (?:allowed )?size|size limit|upload limit|\bfiles? (?:is |are )?too (?:large|big)|\bfiles? (?:urls? )?can ?not be larger",
        // Chinese: request body / file / upload too large.
        r"请求体.{0,6}(?:过大|太大|超过|超出)|文件.{0,6}(?:过大|太大|超过|超出)|上传.{0,8}(?:过大|太大|超过|超出|限制)",
    ]
    .iter()
    .map(|p| re(p))
    .collect()
});

/// Tokens or the context: a size limit never speaks of them.
static SPEAKS_OF_TOKENS: LazyLock<Regex> =
    LazyLock::new(|| re(r"\btokens?\b|\bcontext\b|上下文|令牌|\bprompt (?:is )?too long"));

fn is_size_limit(n: &str) -> bool {
    SIZE_LIMIT.iter().any(|r| r.is_match(n)) && !SPEAKS_OF_TOKENS.is_match(n)
}

/// "Context" in the window sense, and an excess of it.
static CONTEXT_EXCESS: LazyLock<Vec<Regex>> = LazyLock::new(|| {
    [
        // context window / length / size / limit + an excess anywhere in the text.
        r"context (?:window|length|size|limit|budget|token limit)s?\b.*\b(?:exceed\w*|overflow\w*|too (?:long|large|big|small|many)|maximum|max|limit|only|not enough|insufficient|ran out|run out|out of room|reduce|shorter|larger|greater|beyond|full|reached)\b|\b(?:exceed\w*|overflow\w*|too (?:long|large|big|many)|maximum|max|out of room|ran out|run out|beyond|larger than|more than|greater than|exhaust\w*)\b.*\bcontext (?:window|length|size|limit|budget)",
        // context overflow / context exceeded / exceeds (the) context.
        r"context (?:overflow|is full|full|exceeded|too long|too large|limit reached)|(?:exceed\w*|overflow\w*|over|beyond|outside) (?:the |its |this |your |model'?s? |available |maximum |max |allowed |configured )*context\b",
        // "Prompt has 256468 tokens, but the configured context size is 256000 tokens".
        r"\b(?:prompt|input|request|messages?)\b[^.]{0,40}?[0-9]+ tokens?\b.*\bcontext (?:window|length|size|limit)",
        // Joined class or code names: ContextWindowExceededError, context_length_exceeded.
        r"contextwindowexceeded|contextlengthexceeded|contextoverflow|context(?:window|length)(?:error|exceeded)",
        // Chinese: 上下文 (context) with an excess or a request to shrink it.
        r"上下文.{0,12}(?:超出|超过|超长|超限|过长|太长|溢出|压缩|限制|上限|已满|不足)|(?:超出|超过|超长|溢出|压缩).{0,12}上下文",
    ]
    .iter()
    .map(|p| re(p))
    .collect()
});

/// The request / prompt / input itself is too long or exceeds a maximum.
static REQUEST_EXCESS: LazyLock<Vec<Regex>> = LazyLock::new(|| {
    [
        // "prompt is too long", "input is too long for this model",
        // "request too large", "request body too large", "messages too long".
        r"\b(?:prompt|input|inputs|request|message|messages|conversation|history|payload|entity|body|text|query|document)s?\b(?: [^ .;:]+){0,3}? (?:is |are |was |were )?too (?:long|large|big)\b",
        // "... exceeds the maximum / limit / allowed ...", "request exceeded model token limit",
        // "input length 14295 tokens exceeds the model limit".
        r"\b(?:prompt|input|inputs|request|message|messages|conversation|history|payload|tokens|token count|number of tokens|length)\b[^.;]{0,60}?\b(?:exceed|exceeds|exceeded|exceeding|is over|goes over|is larger than|is greater than|is more than|surpass\w*)\b[^.;]{0,60}?(?:\b(?:maximum|max|limit|allowed|model|available|configured|supported|permitted|size|length)\b|[0-9])",
        // "exceeded model token limit", "token limit of the model exceeded".
        r"\b(?:exceed\w*|over|above|beyond) (?:the |this |your )?(?:model'?s? |maximum |max )*(?:input )?token limit|\btoken limit (?:of [^ ]+ )?(?:exceeded|reached)",
        // "too many (input|prompt) tokens", "prompt contains too many tokens".
        r"too many (?:input|prompt|context) tokens|\b(?:prompt|input|request|message|messages)s? (?:[^ .;]+ ){0,3}?(?:has|have|contains?|with) too many tokens",
        // TGI: "`inputs` must have less than 32768 tokens", "`inputs` tokens + `max_new_tokens` must be <= N";
        // DashScope: "Range of input length should be [1, 30720]".
        r"\binputs? (?:tokens )?(?:\+ max new tokens )?must (?:have|be) (?:less than|fewer than|<=|<|at most|shorter)|\b(?:input|prompt) length (?:should|must) be|range of input length",
        // "maximum prompt length is ...", "max input tokens: 8192".
        r"\b(?:maximum|max) (?:prompt|input|context) (?:length|size|tokens?|characters)\b",
        // "please reduce the length of the messages", "reduce your prompt".
        r"reduce (?:the )?(?:length|size) of (?:the |your )?(?:messages?|prompt|input|conversation)|(?:shorten|reduce) (?:your |the )?(?:prompt|input|messages?|conversation)\b|provide a shorter input|submit something shorter",
        // HTTP 413 and its names.
        r"^\s*(?:http\s*)?413\b|(?:http|status(?: code)?|error(?: code)?)\s*[:=]?\s*413\b|\(413\)|entity too large|payload too large",
        // Chinese: input / prompt / request too long or over the token maximum.
        r"(?:输入|提示词|提示|请求|消息|内容|文本|prompt).{0,8}(?:过长|太长|超长|超出|超过|过大|太大)|(?:token|tokens|令牌|字数|长度).{0,8}(?:超出|超过|超限|过多|上限)|超出(?:模型)?最大(?:长度|输入|token)",
    ]
    .iter()
    .map(|p| re(p))
    .collect()
});

/// An output-length limit: the model cannot write that many tokens; a
/// smaller prompt changes nothing. Only a veto when the text says nothing of
/// the input, the prompt or the context.
static OUTPUT_ONLY: LazyLock<Regex> = LazyLock::new(|| {
    re(
        r"\b(?:output|completion|generation|generated|response) (?:tokens?|length|limit)\b|\bmax (?:new |output |completion )?tokens?\b[^.;]{0,30}?\b(?:is too large|too large|must be|should be|cannot exceed|can't exceed|exceeds|above maximum|greater than)|\bmax (?:output|completion) tokens\b|输出",
    )
});
static MENTIONS_INPUT: LazyLock<Regex> = LazyLock::new(|| {
    re(r"\b(?:input|inputs|prompt|context|messages|conversation)\b|上下文|输入|提示")
});

fn is_overflow(n: &str) -> bool {
    if n.is_empty() {
        return false;
    }
    if is_tpm_ceiling(n) {
        return true;
    }
    if VETOES.iter().any(|v| v.is_match(n)) || is_size_limit(n) {
        return false;
    }
    if OUTPUT_ONLY.is_match(n) && !MENTIONS_INPUT.is_match(n) {
        return false;
    }
    CONTEXT_EXCESS.iter().any(|r| r.is_match(n)) || REQUEST_EXCESS.iter().any(|r| r.is_match(n))
}

fn is_tpm_ceiling(n: &str) -> bool {
    TPM_CEILING.captures_iter(n).any(|caps| {
        let limit = caps.get(1).and_then(|m| m.as_str().parse::<u64>().ok());
        let requested = caps.get(2).and_then(|m| m.as_str().parse::<u64>().ok());
        matches!((limit, requested), (Some(l), Some(r)) if l > 0 && r > l)
    })
}

// ---- token counts ----

struct Counts {
    requested: Option<u64>,
    limit: Option<u64>,
    all: Vec<u64>,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Role {
    Requested,
    Limit,
    Other,
}

/// A standalone number: not part of a model name (`gpt-4`), a decimal
/// (`3.5s`) or an id; an optional `k`/`m` multiplier (`128k tokens`).
static NUMBER: LazyLock<Regex> =
    LazyLock::new(|| re(r"(?-u:\b)([0-9]+(?:\.[0-9]+)?)(k|m)?(?-u:\b)"));

/// Keywords before a number saying what it is; the closest one wins.
static REQUESTED_BEFORE: LazyLock<Regex> = LazyLock::new(|| {
    re(
        r"(?:(?:requested|request of|resulted in|given|\bhas|\bhave|contains?|containing|\bsent|received|\bgot|input length|prompt length|input of|prompt of|keep the first|\bcount|total of|your prompt is|your request is|实际|输入)(?: (?:input |prompt )?tokens?)?)(?: (?:about|approximately|around|roughly|a total of))?\W*(?:(?:is|of)\W*)?$",
    )
});
static LIMIT_BEFORE: LazyLock<Regex> = LazyLock::new(|| {
    re(
        r"(?:\b(?:limit|maximum|max|allowed|capacity|supports?)(?: [a-z']+){0,4}?|上限|最大|限制|limited to|at most|up to|<=|<|>|less than|fewer than|\bonly|context (?:length|size|window)|exceed\w*|greater than|more than|larger than|longer than|\bbeyond|\bwindow)\W*(?:(?:of|is|be|to)\W*)?$",
    )
});
/// Words right after a number saying what it is.
static REQUESTED_AFTER: LazyLock<Regex> = LazyLock::new(|| {
    re(
        r"^\s*(?:(?:input |prompt |inputs )?tokens?)?\)?,?\s*(?:>|exceed|would exceed|which exceed|(?:is|are) (?:too|longer|larger|greater|more|over|above|beyond)|in (?:the|your) (?:prompt|messages))",
    )
});
static LIMIT_AFTER: LazyLock<Regex> =
    LazyLock::new(|| re(r"^\s*(?:tokens? )?(?:maximum|max|limit|context (?:length|window|size))"));
static TOKENS_AFTER: LazyLock<Regex> = LazyLock::new(|| {
    re(
        r"^\s*\)?\s*(?:\(?(?:input|inputs|prompt|output|draft|completion|context) )?(?:tokens?|max new tokens|in (?:the|your) (?:prompt|messages|completion)|for the completion)\b",
    )
});
/// A number in another unit than tokens, or an overage (`by 1234 tokens`).
static NOT_A_COUNT_AFTER: LazyLock<Regex> = LazyLock::new(|| {
    re(
        r"^\s*\)?\s*(?:bytes?|kb|mb|gb|kib|mib|gib|characters?|chars|images?|requests?|files?|pages?|seconds?|minutes?|hours?|days?|s|ms|%)(?-u:\b)",
    )
});
static OVERAGE_BEFORE: LazyLock<Regex> = LazyLock::new(|| re(r"\bby\W*$"));
/// What precedes an HTTP status code.
static STATUS_BEFORE: LazyLock<Regex> = LazyLock::new(|| {
    re(r"(?:^|\bhttp(?:/[0-9.]+)?|\bstatus(?: code)?|\berror(?: code)?|\bcode)[\s:=(\[\x22']*$")
});
/// `a + b > c`: prompt plus output reservation against the window.
static SUM_OVER: LazyLock<Regex> = LazyLock::new(|| {
    re(r"(?-u:\b)([0-9]+)\s*\+\s*([0-9]+)\s*(?:>|>=|exceeds?)\s*([0-9]+)(?-u:\b)")
});
/// TGI: `Given: 28897 inputs tokens and 3872 max new tokens`.
static INPUTS_AND_NEW: LazyLock<Regex> = LazyLock::new(|| {
    re(r"given:?\s*([0-9]+)\s*inputs?\s*tokens?\s*(?:and|\+)\s*([0-9]+)\s*max new tokens")
});

fn parse_number(digits: &str, multiplier: Option<&str>) -> Option<u64> {
    let value: f64 = digits.parse().ok()?;
    let scaled = match multiplier {
        Some("k") => value * 1_000.0,
        Some("m") => value * 1_000_000.0,
        _ => {
            if digits.contains('.') {
                return None;
            }
            value
        }
    };
    if !scaled.is_finite() || scaled < 0.0 || scaled > u64::MAX as f64 {
        return None;
    }
    Some(scaled as u64)
}

fn read_token_counts(n: &str) -> Counts {
    let mut requested = None;
    let mut limit = None;
    // Position -> value, so a number seen by two readings is listed once.
    let mut all: BTreeMap<usize, u64> = BTreeMap::new();

    if let Some(c) = SUM_OVER.captures(n) {
        let parts: Vec<Option<(usize, u64)>> = (1..=3)
            .map(|i| {
                c.get(i)
                    .and_then(|m| Some((m.start(), m.as_str().parse().ok()?)))
            })
            .collect();
        if let [Some(a), Some(b), Some(l)] = parts[..] {
            requested = a.1.checked_add(b.1);
            limit = Some(l.1);
            all.extend([a, b, l]);
        }
    }
    if let Some(c) = INPUTS_AND_NEW.captures(n) {
        let a = c.get(1).and_then(|m| m.as_str().parse::<u64>().ok());
        let b = c.get(2).and_then(|m| m.as_str().parse::<u64>().ok());
        if let (Some(a), Some(b)) = (a, b) {
            requested = requested.or(a.checked_add(b));
        }
    }

    let mut previous_end = 0usize;
    for caps in NUMBER.captures_iter(n) {
        let Some(whole) = caps.get(0) else { continue };
        let digits = caps.get(1).map_or("", |m| m.as_str());
        let multiplier = caps.get(2).map(|m| m.as_str());
        let start = whole.start();
        let end = whole.end();
        let window_start = previous_end.max(floor_char_boundary(n, start.saturating_sub(48)));
        previous_end = end;
        // Part of a name or a decimal: gpt-4, claude-3-5, 3.5s, v1.2, org-42.
        let before = n[..start].chars().next_back();
        let after = n[end..].chars().next();
        if before.is_some_and(|c| c.is_alphanumeric() || matches!(c, '-' | '.' | '/' | '_'))
            || after.is_some_and(|c| c == '-' || c == '/')
        {
            continue;
        }
        let Some(value) = parse_number(digits, multiplier) else {
            continue;
        };
        let tail = &n[end..];
        if NOT_A_COUNT_AFTER.is_match(tail) {
            continue;
        }
        let is_tokens = TOKENS_AFTER.is_match(tail);
        // `400 Context size has been exceeded.`: an HTTP status, not a count.
        if (100..600).contains(&value)
            && !is_tokens
            && STATUS_BEFORE.is_match(&n[floor_char_boundary(n, start.saturating_sub(24))..start])
        {
            continue;
        }
        let window = &n[window_start..start];
        let role = if OVERAGE_BEFORE.is_match(window) {
            Role::Other
        } else {
            role_of(window, tail)
        };
        if role == Role::Other && !is_tokens {
            continue;
        }
        all.insert(start, value);
        match role {
            Role::Requested if requested.is_none() => requested = Some(value),
            Role::Limit if limit.is_none() => limit = Some(value),
            _ => {}
        }
    }
    Counts {
        requested,
        limit,
        all: all.into_values().collect(),
    }
}

/// Which of the two a number is, from the closest keyword before it, else
/// from the words after it.
fn role_of(window: &str, tail: &str) -> Role {
    let requested_at = phrase_start(&REQUESTED_BEFORE, window);
    let limit_at = phrase_start(&LIMIT_BEFORE, window);
    match (requested_at, limit_at) {
        // The phrase that starts first is the head of the one that ends at
        // the number: "maximum prompt length is N" is a limit.
        (Some(r), Some(l)) => return if r < l { Role::Requested } else { Role::Limit },
        (Some(_), None) => return Role::Requested,
        (None, Some(_)) => return Role::Limit,
        (None, None) => {}
    }
    if REQUESTED_AFTER.is_match(tail) {
        Role::Requested
    } else if LIMIT_AFTER.is_match(tail) {
        Role::Limit
    } else {
        Role::Other
    }
}

/// Where the keyword phrase that ends `window` starts (the patterns are
/// anchored at the end).
fn phrase_start(pattern: &Regex, window: &str) -> Option<usize> {
    pattern.find(window).map(|m| m.start())
}

fn floor_char_boundary(s: &str, mut i: usize) -> usize {
    while i > 0 && !s.is_char_boundary(i) {
        i -= 1;
    }
    i
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shared_file(name: &str) -> Option<String> {
        let base = env!("CARGO_MANIFEST_DIR");
        // The crate root's sibling `shared/` (a checkout next to the data), or
        // one level further up (a worktree under a sibling directory).
        for dir in ["/../shared/data", "/../../shared/data"] {
            let path = format!("{base}{dir}/provider-errors/{name}");
            if let Ok(text) = std::fs::read_to_string(&path) {
                return Some(text);
            }
        }
        eprintln!("skipped: shared/data/provider-errors/{name} not found next to the crate");
        None
    }

    fn lines(text: &str) -> Vec<&str> {
        text.lines().filter(|l| !l.trim().is_empty()).collect()
    }

    /// Lines of the shared overflow set that are size limits on the
    /// request's bytes, not context overflow: Anthropic's `request_too_large`
    /// message (its 32 MB request limit), and a bare HTTP 413, which is what
    /// nginx, Cloudflare and API gateways answer to a body over their limit
    /// (see [`SIZE_LIMITS`]). Compacting does not lift such a limit.
    const SHARED_POSITIVES_THAT_ARE_SIZE_LIMITS: &[&str] = &[
        "Request exceeds the maximum size",
        "413 Request Entity Too Large",
    ];

    #[test]
    fn every_shared_positive_is_overflow() {
        let Some(text) = shared_file("overflow.txt") else {
            return;
        };
        let (size_limits, positives): (Vec<&str>, Vec<&str>) = lines(&text)
            .into_iter()
            .partition(|l| SHARED_POSITIVES_THAT_ARE_SIZE_LIMITS.contains(&l.trim()));
        let missed: Vec<&str> = positives
            .into_iter()
            .filter(|l| !classify(l).overflow)
            .collect();
        assert!(missed.is_empty(), "not recognized: {missed:#?}");
        // The exceptions are in the file, and read as size limits.
        assert_eq!(
            size_limits.len(),
            SHARED_POSITIVES_THAT_ARE_SIZE_LIMITS.len()
        );
        for l in size_limits {
            let v = classify(l);
            assert!(!v.overflow && v.size_limit, "{l}: {v:?}");
        }
    }

    #[test]
    fn no_shared_negative_is_overflow() {
        let Some(text) = shared_file("not-overflow.txt") else {
            return;
        };
        let wrong: Vec<&str> = lines(&text)
            .into_iter()
            .filter(|l| classify(l).overflow)
            .collect();
        assert!(wrong.is_empty(), "wrongly recognized: {wrong:#?}");
    }

    /// Paraphrases and other providers' wordings, not in the shared files.
    const MORE_POSITIVES: &[&str] = &[
        r#"Error code: 400 - {'error': {'message': "This model's maximum context length is 128000 tokens. However, your messages resulted in 130755 tokens. Please reduce the length of the messages.", 'type': 'invalid_request_error', 'param': 'messages', 'code': 'context_length_exceeded'}}"#,
        "400 INVALID_ARGUMENT: The input token count (1195742) exceeds the maximum number of tokens allowed (1048576).",
        "input length and `max_tokens` exceed context limit: 156321 + 48384 > 200000, decrease input length or `max_tokens` and try again",
        r#"{"object":"error","message":"This model's maximum context length is 32768 tokens. However, you requested 35000 tokens (30000 in the messages, 5000 in the completion). Please reduce the length of the messages or completion.","type":"BadRequestError","param":null,"code":400}"#,
        "Prompt contains 40000 tokens and 0 draft tokens, too large for model with 32768 maximum context length",
        "ValidationException: Input is too long for requested model.",
        "This model's maximum prompt length is 131072 but the request contains 140000 tokens.",
        "too many tokens: total number of tokens in the prompt cannot exceed 4081 - received 4550. Try using a shorter prompt",
        r#"{"error":{"message":"Invalid request: Your request exceeded model token limit: 131072","type":"invalid_request_error"}}"#,
        "InternalError.Algo.InvalidParameter: Range of input length should be [1, 30720]",
        r#"{"error":{"message":"\u8bf7\u6c42\u4e0a\u4e0b\u6587\u957f\u5ea6\u8d85\u51fa\u6a21\u578b\u9650\u5236","type":"invalid_request_error"}}"#,
        "输入内容过长，请缩短后重试",
        "the input length exceeds the context length",
        "Request too large for gpt-4-turbo-preview in organization org-xyz on tokens per min (TPM): Limit 30000, Requested 45210. The input or output tokens must be reduced in order to run successfully.",
        "litellm.ContextWindowExceededError: upstream rejected the request",
        "The message you submitted was too long, please reload the conversation and submit something shorter.",
        "Error: 400 messages: total length of messages exceeds the limit for this model",
        "Too many input tokens. Max input tokens: 8192, request input token count: 9120",
        "Prompt exceeds max length",
        "Your input exceeds the context window of this model. Please adjust your input and try again.",
        "model's context window is full: 200k tokens used",
        "请求的token数超过模型上限",
        "This model's maximum context length is 4097 tokens, however you requested 4927 tokens (3927 in your prompt; 1000 for the completion). Please reduce your prompt; or completion length.",
        "Error: prompt is too long: 215000 tokens > 200000 maximum",
        "anthropic.BadRequestError: Error code: 400 - {'type': 'error', 'error': {'type': 'invalid_request_error', 'message': 'prompt is too long: 201234 tokens > 199999 maximum'}}",
        "openai.BadRequestError: Error code: 400 - {'error': {'message': 'Input tokens exceed the configured limit of 272000 tokens. Your messages resulted in 301234 tokens. Please reduce the length of the messages.', 'type': 'invalid_request_error', 'param': 'messages', 'code': 'context_length_exceeded'}}",
        "The input (305000 tokens) is longer than the model's context length (262144 tokens).",
        "Requested tokens (9000) exceed context window of 8192",
        "400 Bad Request: {\"error\":\"prompt too long; exceeded max context length by 1234 tokens\"}",
        "The prompt is too long for the model. Please shorten it.",
        "BedrockException: Input validation error: too many input tokens",
        "messages: total token count 210000 exceeds limit 200000",
        "Your conversation is too long. Please start a new chat.",
        "maximum context length exceeded",
        "error: the request exceeds the model's context window (requested 140000 tokens, window 128000)",
        "上下文长度超过限制，请减少输入内容",
        "当前对话长度超出模型限制",
        "The request is too large for gpt-4o. Try again with a smaller input.",
        "Tokens in prompt (9500) exceed the model limit (8192)",
        "InvalidArgument: the number of tokens in the input (140001) exceeds the model's context window (131072)",
    ];

    /// Look-alikes that compaction would not fix.
    const MORE_NEGATIVES: &[&str] = &[
        "429 Too Many Requests: Rate limit reached for requests",
        r#"{"type":"error","error":{"type":"rate_limit_error","message":"This request would exceed the rate limit for your organization of 40,000 input tokens per minute. For details, refer to the docs."}}"#,
        "You exceeded your current quota, please check your plan and billing details.",
        "ThrottlingException: Too many tokens, please wait before trying again. You have sent too many tokens per minute.",
        "max_tokens is too large: 32768. This model supports at most 16384 completion tokens, whereas you provided 32768.",
        r#"{"type":"error","error":{"type":"invalid_request_error","message":"max_tokens: 128000 > 64000, which is the maximum allowed number of output tokens for claude-sonnet-4-20250514"}}"#,
        "The requested max_output_tokens (100000) exceeds the maximum allowed value (65536)",
        "Error code: 401 - {'error': {'message': 'Incorrect API key provided', 'type': 'invalid_request_error', 'code': 'invalid_api_key'}}",
        "The model `gpt-6-ultra` does not exist or you do not have access to it.",
        "404 NOT_FOUND: models/gemini-9-pro is not found for API version v1beta",
        "Your request was rejected as a result of our safety system. Your prompt may contain text that is not allowed.",
        "context deadline exceeded (Client.Timeout exceeded while awaiting headers)",
        "RESOURCE_EXHAUSTED: Quota exceeded for quota metric 'Generate Content API requests per minute'",
        "AWS Bedrock: Too many tokens per day. Please try again tomorrow.",
        "Request failed with status 529: Overloaded",
        "messages.3: `tool_use` ids were found without `tool_result` blocks immediately after: toolu_01ABC. Each `tool_use` block must have a corresponding `tool_result` block in the next message.",
        "请求过于频繁，请稍后重试",
        "您的账户额度不足，请充值后重试",
        "Rate limit reached for gpt-4o-mini in organization org-xyz on tokens per min (TPM): Limit 200000, Used 199500, Requested 1200. Please try again in 210ms.",
        "Output length exceeded: the response hit max_tokens before finishing.",
        "The response was filtered due to the prompt triggering Azure OpenAI's content management policy.",
        "Extra usage is required for long context requests.",
        "request reached organization TPD rate limit, current: 1506556, limit: 1500000",
        "Request timed out after 600 seconds",
        "Invalid 'max_completion_tokens': integer above maximum value. Expected a value <= 16384, but got 100000 instead.",
        "413 Request too large on tokens per minute (TPM): Limit 8000, please reduce your message size.",
        "Unsupported value: 'temperature' does not support 0.2 with this model.",
        "",
        "Internal server error",
        "503 Service Unavailable",
        "Error code: 429 - {'error': {'message': 'Request too large for gpt-4o in organization org-x on tokens per min (TPM): Limit 30000, Requested 20000. Please try again.'}}",
        "anthropic.RateLimitError: Error code: 429 - {'type': 'error', 'error': {'type': 'rate_limit_error', 'message': 'Number of request tokens has exceeded your per-minute rate limit'}}",
        "You have exceeded the maximum number of requests",
        "Invalid API key",
        "This model is currently overloaded with other requests.",
        "max_tokens must be at least 1, got -5",
        "Could not finish the message because max_tokens or model output limit was reached. Please try again with higher max_tokens.",
        "Input should be a valid string",
        "image exceeds 5 MB maximum: 7340032 bytes > 5242880 bytes",
        "Total number of images exceeds limit of 100",
        "Your credit balance is too low to access the Anthropic API.",
        "Provider returned error: 402 This request requires more credits, or fewer max_tokens. You requested up to 64000 tokens, but can only afford 12000.",
        "Request rate increased too quickly",
        "tokens per minute limit exceeded",
        "Invalid max_tokens value, the valid range of max_tokens is [1, 8192]",
        "Error: Failed to load model. Not enough memory (context length 32768 too large for available VRAM)",
        "Context caching is not supported for this model",
        "Invalid value for 'context_length': expected integer",
        "messages.1.content.0.image.source.base64: image exceeds 5 MB maximum",
        "Number of request tokens has exceeded your daily rate limit",
    ];

    #[test]
    fn more_positives_are_overflow() {
        let missed: Vec<&str> = MORE_POSITIVES
            .iter()
            .copied()
            .filter(|l| !classify(l).overflow)
            .collect();
        assert!(missed.is_empty(), "not recognized: {missed:#?}");
    }

    /// Request-size limits in bytes, as providers, proxies and gateways
    /// really answer them (each from a public report, cited), and the ones
    /// this file used to count as overflow. Not context overflow: a
    /// compaction would not lift the limit.
    const SIZE_LIMITS: &[&str] = &[
        // anthropics/anthropic-sdk-python#938 (Anthropic, 32 MB Messages API limit).
        "anthropic._exceptions.RequestTooLargeError: Error code: 413 - {'error': {'type': 'request_too_large', 'message': 'Request exceeds the maximum size'}}",
        // earendil-works/pi#2734, anthropics/claude-code#14567.
        r#"413 {"error":{"type":"request_too_large","message":"Request exceeds the maximum size"}}"#,
        // anthropics/claude-code#10314 (stringified twice).
        r#"Error: 413 {\"error\":{\"type\":\"request_too_large\",\"message\":\"Request exceeds the maximum size\"}}"#,
        // open-webui/open-webui#3273 (nginx in front of an OpenAI-compatible endpoint).
        "<html>\n<head><title>413 Request Entity Too Large</title></head>\n<body>\n<center><h1>413 Request Entity Too Large</h1></center>\n<hr><center>nginx/1.26.1</center>\n</body>\n</html>\n<!-- a padding to disable MSIE and Chrome friendly error page -->",
        // CosmosShadow/gptpdf#33 (openresty proxy).
        "<html>\n<head><title>413 Request Entity Too Large</title></head>\n<body>\n<center><h1>413 Request Entity Too Large</h1></center>\n<hr><center>openresty</center>\n</body>\n</html>",
        // openai/codex#2908 (Cloudflare; the user had 92% of the context left).
        "stream error: unexpected status 413 Payload Too Large: <html>\n<head><title>413 Request Entity Too Large</title></head>\n<body>\n<center><h1>413 Request Entity Too Large</h1></center>\n<hr><center>cloudflare</center>",
        // bespokelabsai/curator#111 (OpenAI Files / Batch API, 200 MB).
        "openai.BadRequestError: Error code: 400 - {'error': {'message': 'File is too large.', 'type': 'invalid_request_error', 'param': None, 'code': None}}",
        // CherryHQ/cherry-studio#20938 (an axum-based gateway's body limit).
        "OpenAI API error (413): 413 Failed to buffer the request body: length limit exceeded",
        // vercel/ai#15147 (Azure OpenAI file attachments).
        "File urls can not be larger than 32 mb",
        // koki-develop/lgtm-generator#10 (AWS API Gateway, 10 MB).
        "HTTP content length exceeded 10485760 bytes.",
        // aws/aws-pdk#771 (AWS Lambda invoke payload).
        "1115107 byte payload is too large for the Event invocation type (limit 262144 bytes) (Service: AWSLambda; Status Code: 413; Error Code: RequestEntityTooLargeException; Request ID: 9f16fddd-3500-4106-aba5-07d6398ba67d; Proxy: null)",
        // microsoft/AIforEarth-API-Platform#15 (Flask / werkzeug).
        r#"<!DOCTYPE HTML PUBLIC "-//W3C//DTD HTML 3.2 Final//EN"> <title>413 Request Entity Too Large</title> <h1>Request Entity Too Large</h1> <p>{'message': 'Request content too large (441078). Must be smaller than: 10000'}</p>"#,
        // awslabs/aws-api-gateway-developer-portal#296 (Express raw-body).
        "PayloadTooLargeError: request entity too large",
        // dherault/serverless-offline#282 (hapi).
        "Payload content length greater than maximum allowed: 1048576",
        // Formerly counted as overflow here (the first is Anthropic's
        // `request_too_large` message alone).
        "Request exceeds the maximum size",
        "HTTP 413 Payload Too Large",
        "<html><head><title>413 Request Entity Too Large</title></head><body><center><h1>413 Request Entity Too Large</h1></center><hr><center>nginx</center></body></html>",
        "status code 413: request body exceeds 32 MB limit",
        "google.api_core.exceptions.InvalidArgument: 400 Request payload size exceeds the limit: 20971520 bytes.",
        "Error 413: Request body too large",
        "request_too_large: Request exceeds the maximum allowed number of bytes.",
    ];

    #[test]
    fn size_limits_are_not_overflow() {
        let wrong: Vec<(&str, ErrorVerdict)> = SIZE_LIMITS
            .iter()
            .map(|l| (*l, classify(l)))
            .filter(|(_, v)| v.overflow || !v.size_limit)
            .collect();
        assert!(wrong.is_empty(), "not told apart: {wrong:#?}");
    }

    /// A 413 or a size word beside tokens or the context is a context limit.
    #[test]
    fn a_size_word_beside_tokens_is_still_overflow() {
        for text in [
            "413 Request too large for model `openai/gpt-oss-120b` in organization `org_x` service tier `on_demand` on tokens per minute (TPM): Limit 8000, Requested 8098, please reduce your message size and try again.",
            "HTTP 413: prompt is too long: 215000 tokens > 200000 maximum",
            "status code 413: the request exceeds the model's context window",
        ] {
            let v = classify(text);
            assert!(v.overflow && !v.size_limit, "{text}: {v:?}");
        }
    }

    #[test]
    fn no_overflow_is_a_size_limit() {
        let mut all: Vec<String> = MORE_POSITIVES.iter().map(|s| s.to_string()).collect();
        if let Some(text) = shared_file("overflow.txt") {
            all.extend(lines(&text).into_iter().map(str::to_string));
        }
        for text in &all {
            let v = classify(text);
            assert!(!(v.overflow && v.size_limit), "{text}: {v:?}");
        }
    }

    #[test]
    fn more_negatives_are_not_overflow() {
        let wrong: Vec<&str> = MORE_NEGATIVES
            .iter()
            .copied()
            .filter(|l| classify(l).overflow)
            .collect();
        assert!(wrong.is_empty(), "wrongly recognized: {wrong:#?}");
    }

    fn counts(text: &str) -> (Option<u64>, Option<u64>) {
        let v = classify(text);
        assert!(v.overflow, "not overflow: {text}");
        (v.requested_tokens, v.limit_tokens)
    }

    #[test]
    fn extracts_requested_and_limit() {
        let cases: &[(&str, Option<u64>, Option<u64>)] = &[
            ("prompt is too long: 208423 tokens > 200000 maximum", Some(208423), Some(200000)),
            (
                "400 request (66202 tokens) exceeds the available context size (65536 tokens), try increasing it",
                Some(66202),
                Some(65536),
            ),
            (
                "422 Input validation error: `inputs` tokens + `max_new_tokens` must be <= 32768. Given: 28897 `inputs` tokens and 3872 `max_new_tokens`",
                Some(28897 + 3872),
                Some(32768),
            ),
            (
                "Invalid request: Your request exceeded model token limit: 262144 (requested: 291351)",
                Some(291351),
                Some(262144),
            ),
            (
                "400 Prompt has 256468 tokens, but the configured context size is 256000 tokens",
                Some(256468),
                Some(256000),
            ),
            ("input length 14295 tokens exceeds the model limit", Some(14295), None),
            (
                "Trying to keep the first 15857 tokens when context the overflows. However, the model is loaded with context length of only 4096 tokens, which is not enough.",
                Some(15857),
                Some(4096),
            ),
            (
                "413 Request too large for model `openai/gpt-oss-120b` in organization `org_x` service tier `on_demand` on tokens per minute (TPM): Limit 8000, Requested 8098, please reduce your message size and try again.",
                Some(8098),
                Some(8000),
            ),
            (MORE_POSITIVES[0], Some(130755), Some(128000)),
            (MORE_POSITIVES[1], Some(1195742), Some(1048576)),
            (MORE_POSITIVES[2], Some(156321 + 48384), Some(200000)),
            (MORE_POSITIVES[3], Some(35000), Some(32768)),
            (MORE_POSITIVES[4], Some(40000), Some(32768)),
            (MORE_POSITIVES[6], Some(140000), Some(131072)),
            (MORE_POSITIVES[7], Some(4550), Some(4081)),
            (MORE_POSITIVES[17], Some(9120), Some(8192)),
            ("total tokens exceeds the model's maximum limit of 4,096", None, Some(4096)),
            (
                "The input (305000 tokens) is longer than the model's context length (262144 tokens).",
                Some(305000),
                Some(262144),
            ),
            ("Requested tokens (9000) exceed context window of 8192", Some(9000), Some(8192)),
            (
                "error: the request exceeds the model's context window (requested 140000 tokens, window 128000)",
                Some(140000),
                Some(128000),
            ),
            // An overage is not the request or the window.
            (
                "400 Bad Request: {\"error\":\"prompt too long; exceeded max context length by 1234 tokens\"}",
                None,
                None,
            ),
        ];
        for (text, requested, limit) in cases {
            assert_eq!(counts(text), (*requested, *limit), "{text}");
        }
    }

    #[test]
    fn lists_every_stated_token_count() {
        let v = classify(MORE_POSITIVES[2]);
        assert_eq!(v.token_counts, vec![156321, 48384, 200000]);
        let v = classify("prompt is too long: 208423 tokens > 200000 maximum");
        assert_eq!(v.token_counts, vec![208423, 200000]);
        // The HTTP status is not a token count.
        let v = classify("400 Context size has been exceeded.");
        assert!(v.token_counts.is_empty(), "{:?}", v.token_counts);
    }

    #[test]
    fn size_limits_carry_no_counts() {
        // Bytes are not tokens, and a size limit is no overflow.
        let v = classify("400 Request payload size exceeds the limit: 20971520 bytes.");
        assert_eq!(
            v,
            ErrorVerdict {
                size_limit: true,
                ..ErrorVerdict::default()
            }
        );
    }

    #[test]
    fn non_overflow_carries_no_counts() {
        let v = classify(
            "Rate limit reached for gpt-4o in organization org-abc123 on tokens per min (TPM): Limit 30000, Used 29000, Requested 2000.",
        );
        assert_eq!(v, ErrorVerdict::default());
    }

    #[test]
    fn tolerates_any_input() {
        for text in [
            "\\u",
            "\\ud800",
            "\\ud800\\u0041",
            "\\",
            "é\\u00e9",
            "1,",
            ",1",
            "k",
        ] {
            let _ = classify(text);
        }
    }
}
