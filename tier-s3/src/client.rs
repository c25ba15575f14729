//! The `aws-sdk-s3` client of a tier: credentials from the configuration or
//! the AWS chain (checked before they reach the signer), timeouts, and the
//! SDK's standard retry without retries of a refused connection.

use std::time::Duration;

use aws_config::BehaviorVersion;
use aws_credential_types::provider::error::CredentialsError;
use aws_credential_types::provider::{ProvideCredentials, SharedCredentialsProvider, future};
use aws_sdk_s3::config::interceptors::InterceptorContext;
use aws_sdk_s3::config::retry::{ClassifyRetry, RetryAction, RetryConfig};
use aws_sdk_s3::config::timeout::TimeoutConfig;
use aws_sdk_s3::config::{Credentials, Region};

use crate::config::MAX_DURATION_MS;
use crate::endpoint::CachedEndpoints;
use crate::error::is_connection_refused;
use crate::{S3Config, S3TierError};

/// Builds the client of `config` (already validated).
///
/// # Errors
/// [`S3TierError::InvalidConfig`] for a region from the AWS chain with a
/// control character.
pub(crate) async fn build(config: &S3Config) -> Result<aws_sdk_s3::Client, S3TierError> {
    let mut loader = aws_config::defaults(BehaviorVersion::latest());
    if let (Some(id), Some(secret)) = (&config.access_key_id, &config.secret_access_key) {
        loader = loader.credentials_provider(Credentials::new(
            id,
            secret,
            config.session_token.clone(),
            None,
            "kvtier-config",
        ));
    } else if !config.credentials_from_aws_chain {
        loader = loader.credentials_provider(NoCredentials);
    }
    if let Some(region) = &config.region {
        loader = loader.region(Region::new(region.clone()));
    }
    let shared = loader.load().await;
    if let Some(region) = shared.region()
        && region.as_ref().chars().any(char::is_control)
    {
        return Err(S3TierError::InvalidConfig {
            field: "region",
            reason: "from the AWS chain (AWS_REGION or the profile) has a control character"
                .to_owned(),
        });
    }
    let operation_timeout = config.operation_timeout_ms().unwrap_or(MAX_DURATION_MS);
    let timeouts = TimeoutConfig::builder()
        .connect_timeout(Duration::from_millis(config.connect_timeout_ms))
        .operation_attempt_timeout(Duration::from_millis(config.request_timeout_ms))
        .operation_timeout(Duration::from_millis(operation_timeout))
        .build();
    let mut builder = aws_sdk_s3::config::Builder::from(&shared)
        .force_path_style(config.force_path_style)
        .timeout_config(timeouts)
        .retry_config(RetryConfig::standard().with_max_attempts(config.max_attempts))
        .retry_classifier(NoRetryWhenRefused)
        .endpoint_resolver(CachedEndpoints::new());
    if let Some(chain) = shared.credentials_provider()
        && config.access_key_id.is_none()
        && config.credentials_from_aws_chain
    {
        builder = builder.credentials_provider(CheckedCredentials(chain));
    }
    if shared.region().is_none() {
        builder = builder.region(Region::new("us-east-1"));
    }
    if let Some(endpoint) = &config.endpoint {
        builder = builder.endpoint_url(endpoint);
    }
    Ok(aws_sdk_s3::Client::from_conf(builder.build()))
}

/// The credentials provider when the configuration has none and
/// `credentials_from_aws_chain` is off.
#[derive(Debug)]
struct NoCredentials;

impl ProvideCredentials for NoCredentials {
    fn provide_credentials<'a>(&'a self) -> future::ProvideCredentials<'a>
    where
        Self: 'a,
    {
        future::ProvideCredentials::ready(Err(CredentialsError::not_loaded(
            "none in the configuration, and credentials_from_aws_chain is false",
        )))
    }
}

/// The AWS chain's credentials, refused if the SDK's signer would panic on
/// them (a control character in a value that goes into a header).
#[derive(Debug)]
struct CheckedCredentials(SharedCredentialsProvider);

impl ProvideCredentials for CheckedCredentials {
    fn provide_credentials<'a>(&'a self) -> future::ProvideCredentials<'a>
    where
        Self: 'a,
    {
        future::ProvideCredentials::new(async move {
            let credentials = self.0.provide_credentials().await?;
            let bad = |v: &str| v.chars().any(char::is_control);
            if bad(credentials.access_key_id()) || credentials.session_token().is_some_and(bad) {
                return Err(CredentialsError::invalid_configuration(
                    "the AWS chain gave an access key id or session token with a control character",
                ));
            }
            Ok(credentials)
        })
    }
}

/// Forbids the SDK's retries of a refused connection: nothing listens at
/// the endpoint, and waiting out backoffs would turn a clear "connection
/// refused" into a timeout (the lookup manager backs off by itself).
#[derive(Debug)]
struct NoRetryWhenRefused;

impl ClassifyRetry for NoRetryWhenRefused {
    fn classify_retry(&self, ctx: &InterceptorContext) -> RetryAction {
        match ctx.output_or_error() {
            Some(Err(err))
                if err
                    .as_connector_error()
                    .is_some_and(|c| is_connection_refused(c)) =>
            {
                RetryAction::RetryForbidden
            }
            _ => RetryAction::NoActionIndicated,
        }
    }

    fn name(&self) -> &'static str {
        "kvtier: no retry when refused"
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn chain_credentials_with_a_control_character_are_refused_before_signing() {
        for (id, token) in [("AK\nID", None), ("AKID", Some("to\0ken".to_owned()))] {
            let chain = SharedCredentialsProvider::new(Credentials::new(id, "s", token, None, "t"));
            let err = CheckedCredentials(chain)
                .provide_credentials()
                .await
                .unwrap_err();
            assert!(
                matches!(err, CredentialsError::InvalidConfiguration(_)),
                "{err:?}"
            );
        }
        let chain = SharedCredentialsProvider::new(Credentials::new("AKID", "s", None, None, "t"));
        assert!(
            CheckedCredentials(chain)
                .provide_credentials()
                .await
                .is_ok()
        );
    }
}
