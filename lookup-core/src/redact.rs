//! [`redact_url`]: a configured URL (a server's, an endpoint's) as errors,
//! logs and `Debug` may show it, with every place a credential can hide
//! masked, whether or not the URL parses.

/// `raw` as it may be shown: the scheme and the host kept, anything that
/// may hold a credential masked as `***`. One rule for every tier, applied
/// to the text itself, so a URL that does not parse is masked as well as
/// one that does:
///
/// - **No scheme** (`name:` followed by `/`, or by text with an `@`): the
///   string may be a bare password pasted in the wrong field, so nothing of
///   it shows but its length: `<hidden: 7 characters>`.
/// - **Userinfo**: everything between the scheme's slashes and the last
///   `@` (a password may hold `@`, `:` or `/`) is `***`. If a `?` or `#`
///   comes before that `@` (a password with one of them unencoded, or a
///   query value with an `@`), the userinfo cannot be told from the host,
///   and nothing after the scheme shows.
/// - **A port that is not a number**, in a URL without `@`
///   (`redis://user:password` with the host forgotten): the port and
///   whatever follows it is `***`.
/// - **Query**: each parameter's value is `***` unless its name is in
///   `shown_params` (say `db`); a parameter without a value is `***`.
/// - **Fragment**: `#***`.
///
/// ```
/// use kvtier_core::redact_url;
///
/// assert_eq!(redact_url("redis://u:pw@h:6379/0", &[]), "redis://***@h:6379/0");
/// assert_eq!(redact_url("redis:/u:pw@127.0.0.1:1", &[]), "redis:/***@127.0.0.1:1");
/// assert_eq!(redact_url("unix:///r.sock?db=1&pass=pw", &["db"]), "unix:///r.sock?db=1&pass=***");
/// assert_eq!(redact_url("hunter2", &[]), "<hidden: 7 characters>");
/// ```
pub fn redact_url(raw: &str, shown_params: &[&str]) -> String {
    let Some((scheme, rest)) = split_scheme(raw) else {
        return match raw.chars().count() {
            1 => "<hidden: 1 character>".to_owned(),
            n => format!("<hidden: {n} characters>"),
        };
    };
    let body = rest.trim_start_matches('/');
    let mut out = String::with_capacity(raw.len());
    out.push_str(scheme);
    out.push(':');
    out.push_str(&rest[..rest.len() - body.len()]);
    let after_userinfo = match body.rfind('@') {
        Some(at) if body[..at].contains(['?', '#']) => {
            out.push_str("***");
            return out;
        }
        Some(at) => {
            out.push_str("***@");
            &body[at + 1..]
        }
        None => body,
    };
    let (location, tail) = after_userinfo
        .find(['?', '#'])
        .map_or((after_userinfo, ""), |i| after_userinfo.split_at(i));
    if body.contains('@') {
        out.push_str(location);
    } else {
        push_location_without_userinfo(&mut out, location);
    }
    let (query, fragment) = match tail.find('#') {
        Some(i) => (&tail[..i], Some(&tail[i + 1..])),
        None => (tail, None),
    };
    if let Some(query) = query.strip_prefix('?') {
        out.push('?');
        for (i, pair) in query.split('&').enumerate() {
            if i > 0 {
                out.push('&');
            }
            match pair.split_once('=') {
                Some((name, _)) if shown_params.contains(&name) => out.push_str(pair),
                Some((name, _)) => {
                    out.push_str(name);
                    out.push_str("=***");
                }
                None => out.push_str("***"),
            }
        }
    }
    if let Some(fragment) = fragment {
        out.push('#');
        if !fragment.is_empty() {
            out.push_str("***");
        }
    }
    out
}

/// `(scheme, rest)` if `raw` starts with a scheme (a letter, then letters,
/// digits, `+`, `-` or `.`, then `:`) that is followed by `/` or by text
/// holding an `@`: anything else may be a secret with a colon in it.
fn split_scheme(raw: &str) -> Option<(&str, &str)> {
    let (scheme, rest) = raw.split_once(':')?;
    let mut chars = scheme.chars();
    let well_formed = chars.next().is_some_and(|c| c.is_ascii_alphabetic())
        && chars.all(|c| c.is_ascii_alphanumeric() || matches!(c, '+' | '-' | '.'));
    (well_formed && (rest.starts_with('/') || rest.contains('@'))).then_some((scheme, rest))
}

/// Host, port and path of a URL without userinfo: a port that is not a
/// number (`user:password` with the host forgotten) is masked, with what
/// follows it.
fn push_location_without_userinfo(out: &mut String, location: &str) {
    let authority_end = location.find('/').unwrap_or(location.len());
    let authority = &location[..authority_end];
    // After an IPv6 literal's `]`, or anywhere in a name or IPv4 address.
    let host_end = if authority.starts_with('[') {
        authority.find(']').map_or(authority.len(), |i| i + 1)
    } else {
        0
    };
    match authority[host_end..].rfind(':').map(|i| host_end + i) {
        Some(colon) if !authority[colon + 1..].bytes().all(|b| b.is_ascii_digit()) => {
            out.push_str(&location[..=colon]);
            out.push_str("***");
        }
        _ => out.push_str(location),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every form a credential takes in a Redis URL or an S3 endpoint, the
    /// forms that do not parse, and strings that are no URL at all.
    #[test]
    fn every_place_a_credential_hides_is_masked() {
        let shown = &["db", "protocol"][..];
        for (raw, masked) in [
            // Nothing to hide.
            ("redis://h:1/0", "redis://h:1/0"),
            ("http://127.0.0.1:9000", "http://127.0.0.1:9000"),
            ("http://[::1]:9000/", "http://[::1]:9000/"),
            ("redis://h:1/?protocol=resp3", "redis://h:1/?protocol=resp3"),
            // Userinfo, every form.
            ("redis://u:secret@h:1/0", "redis://***@h:1/0"),
            ("redis://:pw@h:1", "redis://***@h:1"),
            ("rediss://secret@h:1", "rediss://***@h:1"),
            ("valkeys://u:p%40w@h:1/2", "valkeys://***@h:1/2"),
            ("http://user:pw@host:9000/", "http://***@host:9000/"),
            ("https://u:p@ss:w/rd@host", "https://***@host"),
            ("redis://u:p/w@h:1/", "redis://***@h:1/"),
            // Malformed: one slash, three slashes, no slash, no host.
            ("redis:/u:PASSWORD@127.0.0.1:1", "redis:/***@127.0.0.1:1"),
            (
                "redis:///u:PASSWORD@127.0.0.1:1",
                "redis:///***@127.0.0.1:1",
            ),
            ("redis:u:pw@h", "redis:***@h"),
            ("ftp://u:secret@", "ftp://***@"),
            ("unix://u:pw@/r.sock", "unix://***@/r.sock"),
            (
                "redis://alice:pw@127.0.0.1:notaport/",
                "redis://***@127.0.0.1:notaport/",
            ),
            // A userinfo whose '@' and host were forgotten.
            ("redis://user:password", "redis://user:***"),
            ("redis://u:pa/ss", "redis://u:***"),
            ("http://[::1]:x/", "http://[::1]:***"),
            // Query values and fragments.
            (
                "redis+unix:///r.sock?db=3&pass=pw&user=u",
                "redis+unix:///r.sock?db=3&pass=***&user=***",
            ),
            ("unix:///r.sock?pass", "unix:///r.sock?***"),
            ("redis://u:pw@h:port?pass=pw", "redis://***@h:port?pass=***"),
            ("redis://h:1/#pw", "redis://h:1/#***"),
            ("rediss://h:1/#", "rediss://h:1/#"),
            // '?' or '#' before the last '@': nothing after the scheme shows.
            ("redis://user:secret#1@host:6379", "redis://***"),
            ("redis://u:pa?ss@h:1/", "redis://***"),
            ("rediss://u:s#e?c@r@h:1/0?db=1", "rediss://***"),
            ("redis+unix:///r.sock?user=a@b&pass=x", "redis+unix:///***"),
            // No scheme: the length only.
            ("hunter2", "<hidden: 7 characters>"),
            ("p4ss:w0rd", "<hidden: 9 characters>"),
            ("s3.example.com", "<hidden: 14 characters>"),
            ("1redis://h", "<hidden: 10 characters>"),
            ("", "<hidden: 0 characters>"),
            ("x", "<hidden: 1 character>"),
            ("pässwörd", "<hidden: 8 characters>"),
        ] {
            assert_eq!(redact_url(raw, shown), masked, "{raw}");
        }
        // A parameter is shown only when named.
        assert_eq!(redact_url("unix:///s?db=1", &[]), "unix:///s?db=***");
    }
}
