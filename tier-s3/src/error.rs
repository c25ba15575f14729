//! [`S3TierError`] and the classification of S3 errors where they enter.
//!
//! Two steps, as OpenDAL's S3 service does it:
//! - [`classify_response`] is a pure function of an error response's HTTP
//!   status and S3 error code; it is unit-tested as a table, since a test
//!   server cannot produce most of these answers (throttling, 5xx, 400s).
//! - [`from_sdk`] turns one `aws-sdk-s3` error (no credentials, a timeout, a
//!   refused connection, or an error response) into an [`S3TierError`],
//!   calling [`classify_response`] for the responses.

use std::error::Error as StdError;

use aws_credential_types::provider::error::CredentialsError;
use aws_sdk_s3::error::{ProvideErrorMetadata, SdkError};
use kvtier_core::{TierError, TierErrorKind, one_line};

/// An error of the S3 tier; messages name the bucket and endpoint.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum S3TierError {
    /// A configuration field is missing or out of range.
    #[error("invalid S3 tier configuration: {field} {reason}")]
    InvalidConfig {
        /// The field.
        field: &'static str,
        /// What is wrong.
        reason: String,
    },
    /// Access denied, bad or no credentials, or a missing bucket: retrying
    /// will not help.
    #[error("s3://{bucket} at {endpoint}: {reason} (during {op}{})", http_status(*.status))]
    Configuration {
        /// The bucket.
        bucket: String,
        /// The endpoint.
        endpoint: String,
        /// What was being done.
        op: &'static str,
        /// HTTP status; 0 when there was no HTTP exchange (no credentials found).
        status: u16,
        /// What the server said.
        reason: String,
    },
    /// Throttled (503 SlowDown, 429, a throttling error code) after the SDK's retries.
    #[error("s3://{bucket} at {endpoint}: throttled during {op}")]
    Throttled {
        /// The bucket.
        bucket: String,
        /// The endpoint.
        endpoint: String,
        /// What was being done.
        op: &'static str,
    },
    /// No answer in time (connect or request timeout, or the server's own
    /// `RequestTimeout`) after the SDK's retries.
    #[error("s3://{bucket} at {endpoint}: timed out during {op}")]
    Timeout {
        /// The bucket.
        bucket: String,
        /// The endpoint.
        endpoint: String,
        /// What was being done.
        op: &'static str,
    },
    /// The server could not be reached, or failed (5xx) after the SDK's retries.
    #[error("s3://{bucket} at {endpoint}: unavailable during {op}: {detail}")]
    Unavailable {
        /// The bucket.
        bucket: String,
        /// The endpoint.
        endpoint: String,
        /// What was being done.
        op: &'static str,
        /// What happened.
        detail: String,
    },
    /// The server refused the request itself (a 4xx such as 400
    /// `InvalidArgument` or 413 `EntityTooLarge`): sending it again will
    /// not help.
    #[error("s3://{bucket} at {endpoint}: {op} rejected: {detail}")]
    Rejected {
        /// The bucket.
        bucket: String,
        /// The endpoint.
        endpoint: String,
        /// What was being done.
        op: &'static str,
        /// HTTP status.
        status: u16,
        /// What the server said.
        detail: String,
    },
    /// Any other failure.
    #[error("s3://{bucket} at {endpoint}: {op} failed: {detail}")]
    Other {
        /// The bucket.
        bucket: String,
        /// The endpoint.
        endpoint: String,
        /// What was being done.
        op: &'static str,
        /// What happened.
        detail: String,
    },
}

impl S3TierError {
    /// The lookup-core classification.
    pub fn tier_kind(&self) -> TierErrorKind {
        match self {
            Self::InvalidConfig { .. } | Self::Configuration { .. } => TierErrorKind::Config,
            Self::Throttled { .. } => TierErrorKind::Throttled,
            Self::Timeout { .. } => TierErrorKind::Timeout,
            Self::Unavailable { .. } => TierErrorKind::Unavailable,
            Self::Rejected { .. } => TierErrorKind::InvalidInput,
            Self::Other { .. } => TierErrorKind::Other,
        }
    }
}

impl From<S3TierError> for TierError {
    fn from(err: S3TierError) -> Self {
        TierError::new(err.tier_kind(), err.to_string()).with_source(err)
    }
}

/// "; HTTP {status}" for an error that had an HTTP exchange.
fn http_status(status: u16) -> String {
    if status == 0 {
        String::new()
    } else {
        format!("; HTTP {status}")
    }
}

/// What an S3 error response means, from its status and error code alone.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ResponseClass {
    /// 404 without `NoSuchBucket`: the object is missing. A miss for a
    /// read, success for a delete.
    NotFound,
    /// The bucket does not exist: configuration, and the bucket is checked
    /// again before the next request.
    NoSuchBucket,
    /// Access denied, wrong or expired credentials, wrong region: configuration.
    Denied,
    /// Slow down.
    Throttled,
    /// The server timed the request out.
    Timeout,
    /// The server failed (5xx other than 503).
    ServerError,
    /// The request itself is wrong (another 4xx).
    Rejected,
    /// Anything else (a redirect other than 301, a 409 conflict).
    Other,
}

impl ResponseClass {
    /// The lookup-core kind of this class; `None` for
    /// [`NotFound`](Self::NotFound), which is an answer, not an error.
    #[cfg(test)]
    pub(crate) fn kind(self) -> Option<TierErrorKind> {
        match self {
            Self::NotFound => None,
            Self::NoSuchBucket | Self::Denied => Some(TierErrorKind::Config),
            Self::Throttled => Some(TierErrorKind::Throttled),
            Self::Timeout => Some(TierErrorKind::Timeout),
            Self::ServerError => Some(TierErrorKind::Unavailable),
            Self::Rejected => Some(TierErrorKind::InvalidInput),
            Self::Other => Some(TierErrorKind::Other),
        }
    }
}

/// Classifies an S3 error response by its HTTP `status` and S3 error `code`
/// (`""` when the response had none, as a HEAD's never has). The code
/// decides when it is known; the status otherwise.
pub(crate) fn classify_response(status: u16, code: &str) -> ResponseClass {
    match code {
        "NoSuchBucket" => return ResponseClass::NoSuchBucket,
        "AccessDenied"
        | "AccountProblem"
        | "AllAccessDisabled"
        | "InvalidAccessKeyId"
        | "SignatureDoesNotMatch"
        | "ExpiredToken"
        | "InvalidToken"
        | "TokenRefreshRequired"
        | "InvalidSecurity"
        | "AuthorizationHeaderMalformed"
        | "PermanentRedirect"
        | "RequestTimeTooSkewed" => return ResponseClass::Denied,
        "SlowDown"
        | "Throttling"
        | "ThrottlingException"
        | "ThrottledException"
        | "RequestThrottled"
        | "RequestThrottledException"
        | "RequestLimitExceeded"
        | "TooManyRequestsException"
        | "BandwidthLimitExceeded"
        | "ServiceUnavailable" => return ResponseClass::Throttled,
        "RequestTimeout" | "RequestTimeoutException" => return ResponseClass::Timeout,
        "InternalError" => return ResponseClass::ServerError,
        _ => {}
    }
    match status {
        // Wrong region or endpoint: a redirect the SDK does not follow.
        301 | 401 | 403 => ResponseClass::Denied,
        404 => ResponseClass::NotFound,
        408 => ResponseClass::Timeout,
        429 | 503 => ResponseClass::Throttled,
        // A conflicting operation in progress (`OperationAborted`): try later.
        409 => ResponseClass::Other,
        400..=499 => ResponseClass::Rejected,
        500..=599 => ResponseClass::ServerError,
        _ => ResponseClass::Other,
    }
}

/// Where an error happened, for its message: the tier's bucket and
/// endpoint (an endpoint holds no credentials: they are refused).
pub(crate) struct ErrorContext<'a> {
    pub(crate) bucket: &'a str,
    pub(crate) endpoint: &'a str,
}

impl ErrorContext<'_> {
    /// The error of `class` (not [`ResponseClass::NotFound`], which the
    /// caller answers), for a response of `status` / `code` / `message`.
    pub(crate) fn response_error(
        &self,
        op: &'static str,
        class: ResponseClass,
        status: u16,
        code: &str,
        message: &str,
    ) -> S3TierError {
        let bucket = self.bucket.to_owned();
        let endpoint = self.endpoint.to_owned();
        let detail = format!("HTTP {status} {code} {message}").trim().to_owned();
        match class {
            ResponseClass::NoSuchBucket => S3TierError::Configuration {
                bucket,
                endpoint,
                op,
                status,
                reason: "NoSuchBucket: the bucket does not exist".to_owned(),
            },
            ResponseClass::Denied => S3TierError::Configuration {
                bucket,
                endpoint,
                op,
                status,
                reason: if code.is_empty() {
                    format!("HTTP {status}: access denied or wrong credentials")
                } else {
                    format!("{code}: {message}")
                },
            },
            ResponseClass::Throttled => S3TierError::Throttled {
                bucket,
                endpoint,
                op,
            },
            ResponseClass::Timeout => S3TierError::Timeout {
                bucket,
                endpoint,
                op,
            },
            ResponseClass::ServerError => S3TierError::Unavailable {
                bucket,
                endpoint,
                op,
                detail,
            },
            ResponseClass::Rejected => S3TierError::Rejected {
                bucket,
                endpoint,
                op,
                status,
                detail,
            },
            ResponseClass::NotFound | ResponseClass::Other => S3TierError::Other {
                bucket,
                endpoint,
                op,
                detail,
            },
        }
    }
}

/// Every error in `err`'s source chain, `err` first.
fn error_chain<'a>(
    err: &'a (dyn StdError + 'static),
) -> impl Iterator<Item = &'a (dyn StdError + 'static)> {
    std::iter::successors(Some(err), |&e| e.source())
}

/// Whether the chain holds a refused TCP connection.
pub(crate) fn is_connection_refused(err: &(dyn StdError + 'static)) -> bool {
    error_chain(err).any(|e| {
        e.downcast_ref::<std::io::Error>()
            .is_some_and(|io| io.kind() == std::io::ErrorKind::ConnectionRefused)
    })
}

/// Where the AWS chain looks for credentials, for the "no credentials" error.
const CREDENTIAL_SOURCES: &str = "the configuration (access_key_id / secret_access_key), \
     env AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, the profile files ~/.aws/credentials and \
     ~/.aws/config (AWS_PROFILE), web identity (AWS_WEB_IDENTITY_TOKEN_FILE), the ECS container \
     endpoint and EC2 instance metadata";

/// Classifies one SDK error at the boundary: credentials first (no HTTP
/// exchange happened), then timeouts and connection failures, then error
/// responses through [`classify_response`].
pub(crate) fn from_sdk<E>(
    cx: &ErrorContext<'_>,
    op: &'static str,
    err: &SdkError<E, aws_sdk_s3::config::http::HttpResponse>,
) -> S3TierError
where
    E: ProvideErrorMetadata + StdError + 'static,
{
    let bucket = cx.bucket.to_owned();
    let endpoint = cx.endpoint.to_owned();
    let whole: &(dyn StdError + 'static) = err;
    let credentials = error_chain(whole).find_map(|e| e.downcast_ref::<CredentialsError>());
    match (err, credentials) {
        (_, Some(CredentialsError::CredentialsNotLoaded(_))) => S3TierError::Configuration {
            bucket,
            endpoint,
            op,
            status: 0,
            reason: format!(
                "no credentials found; looked in {CREDENTIAL_SOURCES} ({})",
                one_line(whole)
            ),
        },
        (_, Some(CredentialsError::InvalidConfiguration(_))) => S3TierError::Configuration {
            bucket,
            endpoint,
            op,
            status: 0,
            reason: format!("bad credentials: {}", one_line(whole)),
        },
        (_, Some(CredentialsError::ProviderTimedOut(_))) => S3TierError::Timeout {
            bucket,
            endpoint,
            op,
        },
        (_, Some(_)) => S3TierError::Unavailable {
            bucket,
            endpoint,
            op,
            detail: format!("the credentials provider failed: {}", one_line(whole)),
        },
        (SdkError::TimeoutError(_), None) => S3TierError::Timeout {
            bucket,
            endpoint,
            op,
        },
        (SdkError::DispatchFailure(_), None) if is_connection_refused(whole) => {
            S3TierError::Unavailable {
                bucket,
                endpoint,
                op,
                detail: "connection refused".to_owned(),
            }
        }
        (SdkError::DispatchFailure(failure), None) if failure.is_timeout() => {
            S3TierError::Timeout {
                bucket,
                endpoint,
                op,
            }
        }
        (SdkError::DispatchFailure(_), None) => S3TierError::Unavailable {
            bucket,
            endpoint,
            op,
            detail: one_line(whole),
        },
        (SdkError::ServiceError(service), None) => {
            let status = service.raw().status().as_u16();
            let code = service.err().code().unwrap_or("");
            let message = service.err().message().unwrap_or("");
            cx.response_error(op, classify_response(status, code), status, code, message)
        }
        (SdkError::ResponseError(_), None) => S3TierError::Unavailable {
            bucket,
            endpoint,
            op,
            detail: format!("unreadable response: {}", one_line(whole)),
        },
        (_, None) => S3TierError::Other {
            bucket,
            endpoint,
            op,
            detail: one_line(whole),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ResponseClass::*;

    /// (status, code) -> class, and the kind the manager counts it under.
    #[test]
    fn responses_are_classified_by_code_then_status() {
        let table: &[(u16, &str, ResponseClass)] = &[
            // Throttling, by code or by status.
            (503, "SlowDown", Throttled),
            (400, "Throttling", Throttled),
            (400, "ThrottlingException", Throttled),
            (503, "RequestLimitExceeded", Throttled),
            (429, "TooManyRequestsException", Throttled),
            (503, "ServiceUnavailable", Throttled),
            (503, "", Throttled),
            (429, "", Throttled),
            // Server failures.
            (500, "InternalError", ServerError),
            (500, "", ServerError),
            (502, "", ServerError),
            (504, "", ServerError),
            (501, "NotImplemented", ServerError),
            (200, "InternalError", ServerError), // CopyObject's 200 with an error body
            // Configuration: denied, wrong or expired credentials, wrong region.
            (403, "", Denied),
            (403, "AccessDenied", Denied),
            (403, "InvalidAccessKeyId", Denied),
            (403, "SignatureDoesNotMatch", Denied),
            (403, "RequestTimeTooSkewed", Denied),
            (400, "ExpiredToken", Denied),
            (400, "AuthorizationHeaderMalformed", Denied),
            (301, "PermanentRedirect", Denied),
            (301, "", Denied),
            (401, "", Denied),
            // The bucket, whatever the status says.
            (404, "NoSuchBucket", NoSuchBucket),
            (400, "NoSuchBucket", NoSuchBucket),
            // A missing object.
            (404, "", NotFound),
            (404, "NotFound", NotFound),
            (404, "NoSuchKey", NotFound),
            // Timeouts on the server side.
            (400, "RequestTimeout", Timeout),
            (408, "", Timeout),
            // The request itself is wrong.
            (400, "", Rejected),
            (400, "InvalidArgument", Rejected),
            (400, "KeyTooLongError", Rejected),
            (400, "InvalidBucketName", Rejected),
            (411, "MissingContentLength", Rejected),
            (413, "EntityTooLarge", Rejected),
            (405, "MethodNotAllowed", Rejected),
            // Everything else.
            (409, "OperationAborted", Other),
            (307, "TemporaryRedirect", Other),
            (200, "", Other),
        ];
        for &(status, code, class) in table {
            assert_eq!(classify_response(status, code), class, "{status} {code:?}");
        }
        for (class, kind) in [
            (NotFound, None),
            (NoSuchBucket, Some(TierErrorKind::Config)),
            (Denied, Some(TierErrorKind::Config)),
            (Throttled, Some(TierErrorKind::Throttled)),
            (Timeout, Some(TierErrorKind::Timeout)),
            (ServerError, Some(TierErrorKind::Unavailable)),
            (Rejected, Some(TierErrorKind::InvalidInput)),
            (Other, Some(TierErrorKind::Other)),
        ] {
            assert_eq!(class.kind(), kind, "{class:?}");
        }
    }

    /// The error each class becomes keeps the kind the table says, and its
    /// message names the bucket.
    #[test]
    fn response_errors_have_the_kind_of_their_class() {
        let cx = ErrorContext {
            bucket: "b",
            endpoint: "http://h",
        };
        for (status, code) in [
            (503, "SlowDown"),
            (500, ""),
            (403, "AccessDenied"),
            (404, "NoSuchBucket"),
            (408, ""),
            (400, "InvalidArgument"),
            (409, "OperationAborted"),
        ] {
            let class = classify_response(status, code);
            let err = cx.response_error("HeadObject", class, status, code, "message");
            assert_eq!(Some(err.tier_kind()), class.kind(), "{status} {code}");
            let shown = err.to_string();
            assert!(shown.contains("s3://b"), "{shown}");
        }
    }
}
