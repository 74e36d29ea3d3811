//! API errors: every failure answers in OpenAI's error shape with the right status, naming the
//! offending request field when there is one — axum's own extractor rejections included. The
//! routes of Anthropic's Messages API answer the same errors in Anthropic's shape
//! ([`ErrorShape::Anthropic`]).

use std::time::Duration;

use axum::extract::rejection::{BytesRejection, PathRejection};
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;

use super::anthropic::{AnthropicError, AnthropicErrorBody};
use super::openai::{ErrorBody, ErrorDetail};

/// Which API's error body a route answers with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorShape {
    /// `{"error": {"message", "type", "param", "code"}}`, with the error's status.
    OpenAi,
    /// `{"type": "error", "error": {"type", "message"}}`; a 503 (loading, draining, a slot
    /// not freed in time, storage failing) is Anthropic's 529 `overloaded_error`.
    Anthropic,
}

/// Anthropic's "overloaded" status, which its clients retry.
pub const OVERLOADED: u16 = 529;

/// An error response.
#[derive(Debug, Clone)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    pub param: Option<String>,
    pub code: Option<String>,
    /// Seconds for `Retry-After` (429 and 503).
    pub retry_after: Option<u64>,
}

impl ApiError {
    pub fn new(status: StatusCode, message: impl Into<String>) -> ApiError {
        ApiError {
            status,
            message: message.into(),
            param: None,
            code: None,
            retry_after: None,
        }
    }

    /// 400 about request field `param`.
    pub fn invalid(param: &str, message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::BAD_REQUEST, message).param(param)
    }

    pub fn param(mut self, param: &str) -> ApiError {
        self.param = Some(param.to_string());
        self
    }

    pub fn code(mut self, code: &str) -> ApiError {
        self.code = Some(code.to_string());
        self
    }

    pub fn retry_after(mut self, seconds: u64) -> ApiError {
        self.retry_after = Some(seconds);
        self
    }

    /// The OpenAI error `type` for this status.
    pub fn kind(&self) -> &'static str {
        match self.status.as_u16() {
            400 | 408 | 413 | 422 => "invalid_request_error",
            401 => "authentication_error",
            403 => "permission_error",
            404 => "not_found_error",
            429 => "rate_limit_error",
            503 => "service_unavailable",
            _ => "server_error",
        }
    }

    /// Anthropic's status and error `type` for this error.
    pub fn anthropic_kind(&self) -> (StatusCode, &'static str) {
        let kind = match self.status.as_u16() {
            400 | 405 | 408 | 422 => "invalid_request_error",
            401 => "authentication_error",
            403 => "permission_error",
            404 => "not_found_error",
            413 => "request_too_large",
            429 => "rate_limit_error",
            503 => {
                let overloaded =
                    StatusCode::from_u16(OVERLOADED).unwrap_or(StatusCode::SERVICE_UNAVAILABLE);
                return (overloaded, "overloaded_error");
            }
            _ => "api_error",
        };
        (self.status, kind)
    }

    /// The body in Anthropic's shape; the field at fault, when there is one, is named in the
    /// message (Anthropic's errors have no `param`).
    pub fn anthropic_body(&self) -> AnthropicErrorBody {
        let message = match &self.param {
            Some(p) if !self.message.contains(p.as_str()) => {
                format!("{}: {}", p, self.message)
            }
            _ => self.message.clone(),
        };
        AnthropicErrorBody {
            kind: "error".into(),
            error: AnthropicError {
                kind: self.anthropic_kind().1.into(),
                message,
            },
        }
    }

    /// The response in `shape`.
    pub fn into_shaped_response(self, shape: ErrorShape) -> Response {
        let (status, body) = match shape {
            ErrorShape::OpenAi => (self.status, Json(self.body()).into_response()),
            ErrorShape::Anthropic => (
                self.anthropic_kind().0,
                Json(self.anthropic_body()).into_response(),
            ),
        };
        let mut response = body;
        *response.status_mut() = status;
        self.add_headers(&mut response);
        response
    }

    /// The headers every error response carries: `Retry-After`, `Connection: close` after a
    /// body timeout, `WWW-Authenticate` on a 401.
    fn add_headers(&self, response: &mut Response) {
        if let Some(s) = self.retry_after {
            if let Ok(v) = HeaderValue::from_str(&s.to_string()) {
                response.headers_mut().insert(header::RETRY_AFTER, v);
            }
        }
        if self.status == StatusCode::REQUEST_TIMEOUT {
            // The rest of the body may still come: the connection cannot carry another request.
            response
                .headers_mut()
                .insert(header::CONNECTION, HeaderValue::from_static("close"));
        }
        if self.status == StatusCode::UNAUTHORIZED {
            response
                .headers_mut()
                .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        }
    }

    /// The JSON body.
    pub fn body(&self) -> ErrorBody {
        ErrorBody {
            error: ErrorDetail {
                message: self.message.clone(),
                kind: self.kind().to_string(),
                param: self.param.clone(),
                code: self.code.clone(),
            },
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        self.into_shaped_response(ErrorShape::OpenAi)
    }
}

/// A request body that had not arrived whole `body_timeout_secs` after its headers.
#[derive(Debug)]
pub struct BodyTimeout(pub Duration);

impl std::fmt::Display for BodyTimeout {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "the request body did not arrive within {} s of its headers (the server's body_timeout_secs)",
            self.0.as_secs()
        )
    }
}

impl std::error::Error for BodyTimeout {}

/// A body that could not be read: too large (413), too slow (408) or cut off (400).
impl From<BytesRejection> for ApiError {
    fn from(rejection: BytesRejection) -> ApiError {
        let mut cause: Option<&(dyn std::error::Error + 'static)> = Some(&rejection);
        while let Some(e) = cause {
            if let Some(timeout) = e.downcast_ref::<BodyTimeout>() {
                return ApiError::new(StatusCode::REQUEST_TIMEOUT, timeout.to_string())
                    .code("request_timeout");
            }
            cause = e.source();
        }
        let status = rejection.status();
        if status == StatusCode::PAYLOAD_TOO_LARGE {
            ApiError::new(
                status,
                "request body too large (the server's max_body_bytes limit)",
            )
        } else {
            ApiError::new(status, rejection.body_text())
        }
    }
}

/// A path parameter that does not decode (e.g. percent-encoded bytes that are not UTF-8).
impl From<PathRejection> for ApiError {
    fn from(rejection: PathRejection) -> ApiError {
        ApiError::new(rejection.status(), rejection.body_text())
    }
}
