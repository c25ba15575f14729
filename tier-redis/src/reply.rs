//! Reply parsing: what the server's replies to the tier's commands mean,
//! as pure functions of the replies. Both lookup paths read EXISTS answers
//! with [`exists_answer`]; a reply of the wrong shape is an error string
//! that the tier turns into [`RedisTierError::UnexpectedReply`](crate::RedisTierError::UnexpectedReply).

use redis::Value;

/// The answer of one single-key EXISTS: `0` absent, `1` present; any other
/// integer (negative, a count above one) is no answer EXISTS gives. Both
/// paths read replies with this rule.
pub(crate) fn exists_answer(n: i64) -> Option<bool> {
    match n {
        0 => Some(false),
        1 => Some(true),
        _ => None,
    }
}

/// The answers of an EXISTS pipeline of `keys` commands and its end marker,
/// read with the lean path's rule: each answer `0` or `1`
/// ([`exists_answer`]), then the marker's simple string, last.
pub(crate) fn exists_answers(mut values: Vec<Value>, keys: usize) -> Result<Vec<bool>, String> {
    if values.len() != keys + 1 {
        return Err(format!(
            "{} replies to {keys} EXISTS and an end marker",
            values.len()
        ));
    }
    match values.pop() {
        // Any simple string, as the lean path takes it (`+OK` is `Okay`).
        Some(Value::SimpleString(_) | Value::Okay) => {}
        _ => return Err("replies out of step: the end marker's reply is not last".to_owned()),
    }
    values
        .into_iter()
        .map(|value| match value {
            Value::Int(n) => {
                exists_answer(n).ok_or_else(|| format!("an EXISTS answer other than 0 or 1: {n}"))
            }
            _ => Err("an EXISTS answer that is not an integer".to_owned()),
        })
        .collect()
}

/// A `GET` reply: the payload, or `None` for an absent key.
pub(crate) fn payload(value: Value) -> Result<Option<Vec<u8>>, String> {
    match value {
        Value::Nil => Ok(None),
        Value::BulkString(bytes) => Ok(Some(bytes)),
        _ => Err("a GET answer that is neither a payload nor nil".to_owned()),
    }
}

/// The replies of a pipeline of `commands` commands, one each.
pub(crate) fn one_per_command(values: Vec<Value>, commands: usize) -> Result<Vec<Value>, String> {
    if values.len() == commands {
        Ok(values)
    } else {
        Err(format!("{} replies to {commands} commands", values.len()))
    }
}

/// The values of a pipeline holding one `MGET` of `keys` names: one array
/// of `keys` values.
pub(crate) fn mget_values(values: Vec<Value>, keys: usize) -> Result<Vec<Value>, String> {
    match values.into_iter().next() {
        Some(Value::Array(values)) if values.len() == keys => Ok(values),
        _ => Err("not one answer per key".to_owned()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ints(ns: &[i64]) -> Vec<Value> {
        ns.iter().map(|&n| Value::Int(n)).collect()
    }

    fn marked(mut values: Vec<Value>) -> Vec<Value> {
        values.push(Value::SimpleString("none".to_owned()));
        values
    }

    #[test]
    fn exists_pipelines_read_zero_or_one_then_the_end_marker_last() {
        let bulk = || Value::BulkString(b"1".to_vec());
        /// Replies, keys asked, and the answers or a part of the error.
        type Case = (Vec<Value>, usize, Result<Vec<bool>, &'static str>);
        let cases: Vec<Case> = vec![
            (marked(ints(&[1, 0, 1])), 3, Ok(vec![true, false, true])),
            (marked(vec![]), 0, Ok(vec![])),
            ([ints(&[0]), vec![Value::Okay]].concat(), 1, Ok(vec![false])),
            (marked(ints(&[1, 2])), 2, Err("other than 0 or 1: 2")),
            (marked(ints(&[-1])), 1, Err("other than 0 or 1: -1")),
            (marked(vec![bulk()]), 1, Err("not an integer")),
            // A reply missing, or one too many: the marker is out of place.
            (marked(ints(&[1])), 2, Err("2 replies to 2 EXISTS")),
            (marked(ints(&[1, 1, 1])), 2, Err("4 replies to 2 EXISTS")),
            (ints(&[1, 1]), 1, Err("end marker's reply is not last")),
            (vec![], 0, Err("0 replies to 0 EXISTS")),
        ];
        for (values, keys, expected) in cases {
            let shown = format!("{values:?}");
            match (exists_answers(values, keys), expected) {
                (Ok(found), Ok(expected)) => assert_eq!(found, expected, "{shown}"),
                (Err(detail), Err(needle)) => {
                    assert!(detail.contains(needle), "{shown}: {detail}")
                }
                (got, expected) => panic!("{shown}: {got:?}, expected {expected:?}"),
            }
        }
    }

    #[test]
    fn loads_read_payloads_nil_and_one_answer_per_key() {
        assert_eq!(payload(Value::Nil), Ok(None));
        assert_eq!(
            payload(Value::BulkString(b"kv".to_vec())),
            Ok(Some(b"kv".to_vec()))
        );
        assert!(payload(Value::Int(1)).is_err());
        assert!(payload(Value::Okay).is_err());

        let array = |n| vec![Value::Array(vec![Value::Nil; n])];
        assert_eq!(mget_values(array(2), 2), Ok(vec![Value::Nil; 2]));
        assert!(mget_values(array(1), 2).is_err());
        assert!(mget_values(vec![Value::Nil], 1).is_err());
        assert!(mget_values(vec![], 0).is_err());

        assert_eq!(one_per_command(ints(&[1, 1]), 2), Ok(ints(&[1, 1])));
        assert_eq!(
            one_per_command(ints(&[1]), 2),
            Err("1 replies to 2 commands".to_owned())
        );
    }
}
